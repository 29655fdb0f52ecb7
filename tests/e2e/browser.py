"""Headless Chromium for the browser test: Debian's ``chromium`` + ``chromedriver`` driven by selenium.

Nothing is downloaded at run time (Selenium Manager is bypassed by naming the driver binary), so
this works on a machine that reaches only package registries; ``scripts/system/chromium.sh``
installs both binaries. Every step the test takes leaves a numbered screenshot in the test's
artifact folder (``test-artifacts/browser/<test>/``, ignored by git); a failure inside the
``with Browser(...)`` block also leaves ``failure.png``, ``failure.html`` (page source) and
``failure-console.txt`` (the browser's console), so a red run can be read without re-running it.

Waits are explicit (``WebDriverWait`` on a real element or text); a wait that runs out fails with
what it waited for and the URL it was on.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from kiln.shipped import CHECKOUT

ARTIFACTS_ROOT = CHECKOUT / "test-artifacts" / "browser"
CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def _chromium_binaries() -> tuple[str | None, str | None]:
    browser = next((path for name in CHROMIUM_CANDIDATES if (path := shutil.which(name))), None)
    return browser, shutil.which("chromedriver")


def chromium_unavailable() -> str | None:
    """Why the browser test cannot run here (None: it can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (it is in requirements.in: run make)"
    browser, driver = _chromium_binaries()
    if browser is None or driver is None:
        return "chromium/chromedriver not installed (run: sudo bash scripts/system/chromium.sh, or make system-deps)"
    return None


def artifact_dir(test_name: str) -> Path:
    """A fresh artifact folder for one test (old screenshots of the same test are removed)."""
    folder = ARTIFACTS_ROOT / re.sub(r"[^A-Za-z0-9_.-]+", "_", test_name)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


class Browser:
    """One headless Chromium session whose steps are screenshotted into ``folder``."""

    def __init__(self, folder: Path, *, timeout: float = 60.0, width: int = 1400, height: int = 1000):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        browser, driver = _chromium_binaries()
        if browser is None or driver is None:
            raise RuntimeError(chromium_unavailable() or "chromium not found")
        self.folder = folder
        self.timeout = timeout
        self._steps = 0
        options = webdriver.ChromeOptions()
        options.binary_location = browser
        for arg in (
            "--headless=new",
            "--no-sandbox",  # runs as root in CI and on the development machines
            "--disable-dev-shm-usage",
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
            "--password-store=basic",  # no keyring prompt/wait on a headless machine
            f"--window-size={width},{height}",
            f"--user-data-dir={folder / '.profile'}",
        ):
            options.add_argument(arg)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        # chromedriver's INFO log logs every poll of every wait (megabytes); warnings are what explain a failure.
        service = Service(driver, service_args=["--log-level=WARNING"], log_output=str(folder / "chromedriver.log"))
        self.driver = webdriver.Chrome(options=options, service=service)
        self.driver.set_page_load_timeout(timeout)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Browser:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if exc_type is not None:
                self.dump("failure")
        finally:
            self.driver.quit()
            shutil.rmtree(self.folder / ".profile", ignore_errors=True)

    # ------------------------------------------------------------------ artifacts
    def step(self, name: str) -> Path:
        """Screenshot the page as the next numbered step (``03-approved.png``)."""
        self._steps += 1
        path = self.folder / f"{self._steps:02d}-{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    def dump(self, name: str) -> None:
        """Screenshot + page source + console log, for reading a failure afterwards."""
        driver = self.driver
        for write in (
            lambda: driver.save_screenshot(str(self.folder / f"{name}.png")),
            lambda: (self.folder / f"{name}.html").write_text(f"<!-- {driver.current_url} -->\n{driver.page_source}"),
            lambda: (self.folder / f"{name}-console.txt").write_text(
                "\n".join(f"{e.get('level')} {e.get('message')}" for e in driver.get_log("browser"))
            ),
        ):
            with contextlib.suppress(Exception):  # a dead browser must not hide the test's own error
                write()

    # ------------------------------------------------------------------ navigation and waits
    def get(self, url: str) -> None:
        self.driver.get(url)

    def wait(self, condition: Callable[[Any], Any], what: str, timeout: float | None = None) -> Any:
        """Wait until ``condition(driver)`` is truthy and return it; fail saying ``what`` was awaited."""
        from selenium.common.exceptions import TimeoutException
        from selenium.webdriver.support.ui import WebDriverWait

        limit = self.timeout if timeout is None else timeout
        try:
            return WebDriverWait(self.driver, limit, poll_frequency=0.5).until(condition)
        except TimeoutException:
            raise AssertionError(f"waited {limit:.0f}s for {what} on {self.driver.current_url}") from None

    def css(self, selector: str, *, within: Any = None, timeout: float | None = None, visible: bool = True) -> Any:
        """The first element matching ``selector`` (visible unless ``visible=False``), once there."""
        from selenium.webdriver.common.by import By

        def found(driver: Any) -> Any:
            for el in (within or driver).find_elements(By.CSS_SELECTOR, selector):
                if not visible or el.is_displayed():
                    return el
            return None

        return self.wait(found, f"element {selector!r}", timeout)

    def css_with_text(self, selector: str, text: str, *, within: Any = None, timeout: float | None = None) -> Any:
        """The first visible element matching ``selector`` whose text contains ``text``."""
        from selenium.common.exceptions import StaleElementReferenceException
        from selenium.webdriver.common.by import By

        def found(driver: Any) -> Any:
            try:
                for el in (within or driver).find_elements(By.CSS_SELECTOR, selector):
                    if el.is_displayed() and text in el.text:
                        return el
            except StaleElementReferenceException:  # React re-rendered under us: look again
                return None
            return None

        return self.wait(found, f"{selector!r} showing {text!r}", timeout)

    def value(self, selector: str, *, within: Any = None) -> str | None:
        """The ``value`` of the first element matching ``selector`` now (None: no such element)."""
        from selenium.common.exceptions import StaleElementReferenceException
        from selenium.webdriver.common.by import By

        try:
            found = (within or self.driver).find_elements(By.CSS_SELECTOR, selector)
            return found[0].get_attribute("value") if found else None
        except StaleElementReferenceException:
            return None

    def page_text(self, text: str, *, timeout: float | None = None) -> None:
        """Wait until the page's visible text contains ``text``."""
        self.css_with_text("body", text, timeout=timeout)

    def url_contains(self, fragment: str, *, timeout: float | None = None) -> str:
        self.wait(lambda d: fragment in d.current_url, f"the URL to contain {fragment!r}", timeout)
        return self.driver.current_url


def fill(element: Any, value: object) -> None:
    """Replace an input's value by typing (React-controlled inputs ignore a set ``value``)."""
    from selenium.webdriver.common.keys import Keys

    element.send_keys(Keys.CONTROL, "a")
    element.send_keys(Keys.BACKSPACE)
    element.send_keys(str(value))


def airflow_login(browser: Browser, base_url: str, username: str, password: str) -> None:
    """Log in on the Airflow UI's SimpleAuthManager page and wait for the app shell."""
    browser.get(f"{base_url.rstrip('/')}/")
    browser.css("input[name=username]").send_keys(username)
    browser.css("input[name=password]").send_keys(password)
    browser.step(f"login-{username}")
    browser.css("button[type=submit]").click()
    browser.css("[data-testid=nav-dags-link]")
    browser.wait(lambda d: "/auth/login" not in d.current_url, "the login page to go away")


def mlflow_show_lineage(browser: Browser, mlflow_url: str, model: str, version: Any, tags: dict[str, str]) -> None:
    """Open the MLflow UI's model version page and check that each tag in ``tags`` shows its value."""
    browser.get(f"{mlflow_url.rstrip('/')}/#/models/{model}/versions/{version}")
    first = browser.css(f"tr[data-row-key='{next(iter(tags))}']")
    browser.driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", first)  # tags into the screenshot
    for tag, value in tags.items():
        shown = browser.css(f"tr[data-row-key='{tag}'] td:nth-child(2)").text.strip()
        assert shown == value, f"MLflow UI shows {tag}={shown!r} on {model} v{version}; the registry has {value!r}"


def mlflow_open_artifact(browser: Browser, run_id: str, path: str) -> Any:
    """From a page that links the source run: open its Artifacts tab and select ``path``
    (``dir/file``); returns the preview iframe for HTML artifacts."""
    browser.css(f"a[href*='/runs/{run_id}']").click()
    browser.css("[role=tab][id$='-trigger-artifacts']").click()
    return mlflow_select_artifact(browser, path)


def mlflow_select_artifact(browser: Browser, path: str) -> Any:
    """On a run's Artifacts tab (the main document, not a preview frame): select ``path`` (``dir/file``)
    in the artifact tree; returns the preview iframe for HTML artifacts."""
    *folders, name = path.split("/")
    for folder in folders:
        browser.css(f"[data-testid=artifact-tree-node][artifact-name='{folder}']").click()
    browser.css(f"[data-testid=artifact-tree-node][artifact-name='{name}']").click()
    browser.page_text(path)  # the preview's header names the selected file
    return browser.css("iframe")
