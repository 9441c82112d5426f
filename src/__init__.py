"""medsweep: measure how to train 3D medical-image classifiers fastest and in the least memory."""

import atexit
import gc
import sys

from src.errors import stop_while_importing
from src.redaction import redact_output

redact_output()  # every log record and uncaught traceback of any process that imports src: secrets as ***
# run after the atexit handlers registered later: the interpreter's exit then skips its full collections of the
# objects torch, Hydra and MLflow leave behind (seconds in every process: docs/architecture.md)
atexit.register(gc.freeze)

if sys.argv[:1] == ["-m"]:  # python -m src.<command> is importing its package: Ctrl-C in the imports is one line
    stop_while_importing()

from src.data import shipped  # noqa: E402  (after the handler: it imports OmegaConf)

shipped.register()  # here, so every composition of conf/ (it imports src) resolves ${shipped:...}
