"""The file MLflow logs as a registered version's model code (models from code).

``mlflow.pyfunc.log_model(python_model=<this file>)`` stores this file and runs it on load; it names
the served model, ``kiln_trainer.serving.TextGenerator``. Logging an instance instead would store
it as ``python_model.pkl`` (cloudpickle), and loading that runs whatever the artifact store holds.
"""

from mlflow.models import set_model

from kiln_trainer.serving import TextGenerator

set_model(TextGenerator())
