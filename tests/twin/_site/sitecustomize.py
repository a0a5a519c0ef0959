"""The twin's stand-in for a pod's hostname (tests/twin/pods.py puts this directory on PYTHONPATH).

A process cannot change the machine's hostname, so inside a twin pod `socket.gethostname()` and
`platform.node()` return $HOSTNAME, which the twin sets to the pod's hostname: the pod name truncated to 63
characters, as the kubelet does. `os.uname().nodename` and the `hostname` command still show the machine.
"""

import os

_name = os.environ.get("TWIN_POD_HOSTNAME")
if _name:
    import platform
    import socket

    socket.gethostname = lambda: _name
    platform.node = lambda: _name
