"""Small helpers with one concern each, used across kiln: nothing here knows what a run is.

    fs      crash-safe writes (tmp, fsync, rename), path checks, OS errors in one line
    procs   ending the process groups kiln starts; services behind a pid file
    net     a free port on 127.0.0.1
"""
