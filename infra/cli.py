"""How the command-line programs (train, finetune, eval, sample, data, `python -m infra.checkpoint`) end.

A mistake in what the user gave (a config value, a command-line argument, a path, a damaged file) raises a
UserError: `run` prints it as one line, `prog: error: message`, with no traceback, and exits with status 1;
under torchrun only rank 0 prints it, since every rank meets the same mistake. Anything else is a bug and keeps
Python's full traceback. The exception's type decides, as in argparse and click: not where it was raised, so a
helper function may raise a UserError for its caller.

Library code (model.py, router.py, depth_kernels/) knows nothing of users and raises ValueError; where user input
reaches it (a ModelConfig made from a config file or a checkpoint's model_config), the caller turns that
ValueError into a UserError with the same message (config.checked).

The subclasses below name a kind of mistake and also derive from the builtin exception of that kind, so that
`except FileNotFoundError` still catches a missing file. Others live where their mistakes are found:
config.ConfigError, shards.DataError, checkpoint.CheckpointError, files.DamagedFileError. Command-line
arguments that argparse reads are argparse's to refuse (positive_int is a type for it).

A RankFailureError (under torchrun, another rank hung or died) ends the process as soon as its line is printed
(os._exit, no interpreter shutdown): the collective that failed may still be running on a worker thread of the
process group, and Python's own exit frees the group while holding the GIL, which gloo's destructor then waits
on while it joins that thread, which waits for the GIL: the job would hang, the very thing the error reports.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Callable, Iterator


class UserError(Exception):
    """A mistake in what the user gave, described in full by its one-line message (see the module doc)."""


class UsageError(UserError, ValueError):
    """A setting or command-line argument that is not allowed (config.ConfigError: one in a config)."""


class NotFoundError(UserError, FileNotFoundError):
    """A file or folder that the user named, or that an earlier step should have made, does not exist."""


class InUseError(UserError, FileExistsError):
    """A folder that another process or another run holds."""


class MissingPackageError(UserError, ModuleNotFoundError):
    """An optional package that a chosen option needs is not installed."""


class RankFailureError(UserError):
    """Under torchrun, another rank hung or died (distributed.RankTimeoutError, distributed.RankLostError): `run`
    ends the process without Python's shutdown (see the module doc)."""


class NetworkError(UserError, ConnectionError):
    """A download failed: no network, the hub unreachable, or offline mode without a local copy."""


# Exceptions, by class name anywhere in their class's ancestry (so that no package has to be imported to name
# them), that mean a download could not be made: requests', httpx's, huggingface_hub's and the builtins'.
_NETWORK_FAILURES = {"ConnectionError", "ConnectError", "Timeout", "TimeoutError", "TimeoutException",
                     "LocalEntryNotFoundError", "OfflineModeIsEnabled", "NameResolutionError"}


@contextlib.contextmanager
def downloading(what: str, offline: str) -> Iterator[None]:
    """Around code that downloads `what`: a failure of the network becomes a NetworkError that names what could
    not be fetched and `offline`, what to do without a network."""
    try:
        yield
    except Exception as error:
        if not {c.__name__ for c in type(error).__mro__} & _NETWORK_FAILURES:
            raise
        raise NetworkError(f"could not download {what} ({type(error).__name__}: no network, or the server is not "
                           f"reachable); {offline}") from None


def positive_int(text: str) -> int:
    """An argparse `type`: an integer >= 1; argparse reports anything else as a usage error of its own."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed values are integers >= 1")
    return value


def run(main: Callable[[list[str]], object]) -> None:
    """Call main(sys.argv[1:]) and end the process as the module doc says; an int that main returns is the
    exit status."""
    prog = os.path.basename(sys.argv[0])
    speaks = int(os.environ.get("RANK", "0")) == 0
    try:
        status = main(sys.argv[1:])
    except KeyboardInterrupt:
        if speaks:
            print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    except UserError as error:
        if speaks:
            print(f"{prog}: error: {error}", file=sys.stderr)
        if isinstance(error, RankFailureError):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        sys.exit(1)
    sys.exit(status if isinstance(status, int) else 0)
