import os
import sys

from shardwise.cli import main

code = main()
if os.environ.get("TORCHELASTIC_RUN_ID") is not None:
    # A torchrun worker whose command has finished (its process group destroyed, checkpoints, metrics and logs
    # closed) leaves without interpreter finalization: with gloo, torch 2.13 can abort there (SIGABRT,
    # "terminate called without an active exception") while destroying the worker threads' leftover work
    # objects, which torchrun then reports as a failed job (pytorch/pytorch#179291 describes the teardown
    # race). Exceptions do not get here: they end the process the normal way, with their traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
