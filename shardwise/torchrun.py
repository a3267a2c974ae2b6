"""`python -m shardwise.torchrun ARGS`: torchrun, with its arguments, for `shardwise train --nproc`.

A job that fails with a shardwise error (a bad config, checkpoint or run, which every rank meets and rank 0 prints
as one line) ends with that line once and its exit code (2 or 3), instead of exit code 1 after torchrun's
multi-screen ChildFailedError report with torchrun's own traceback. Any other failure keeps torchrun's report, and
the failed rank's traceback, which the rank prints itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import uuid

from torch.distributed import run as torchrun
from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import api as multiprocessing_api
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from shardwise.distributed import ATTEMPT_ENV, handed_error, restart_cannot_help

_STOPPING_LOGGER = "torch.distributed.elastic.multiprocessing.api"
"""torchrun's logger for a failed worker group: "failed (exitcode: 3) local_rank: 0 ..." and "Sending process ...
closing signal SIGTERM" for each rank still running."""


class _HeldBack(logging.Filter):
    """Keeps a logger's records back (to be handled or dropped once the job's outcome is known)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


_BACKEND = "shardwise-c10d"
_ATTEMPT_KEY = "shardwise/attempt"


def _c10d_naming_attempts(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's c10d rendezvous, which also gives each of its rounds a name that every rank of the round reads
    (ATTEMPT_ENV, in the environment the workers inherit): the prefix of their keys in the job's store.

    Workers of every round share one store, and torchrun's own per-attempt number (TORCHELASTIC_RESTART_COUNT)
    counts each machine's failures, so it differs between machines once one joins a running job. The round's
    store (torchrun's, prefixed by the round) is fresh each round: the rank-0 machine writes the name there and the
    others wait for it. The name is its clock in nanoseconds, so later rounds sort after earlier ones (the sample
    log uses that when a step ran twice, on two worlds).
    """
    backend, store = create_backend(params)
    handler = create_handler(store, backend, params)
    join = handler.next_rendezvous

    def next_rendezvous():
        info = join()
        if info.rank == 0:
            info.store.set(_ATTEMPT_KEY, str(time.time_ns()))
        os.environ[ATTEMPT_ENV] = info.store.get(_ATTEMPT_KEY).decode()
        return info

    handler.next_rendezvous = next_rendezvous
    handler.get_backend = lambda: _BACKEND  # the name it was asked for under (the registry checks)
    return handler


def _stop_ranks_first(signum: int, frame) -> None:
    """torchrun's handler of its termination signals, but SIGTERM while its ranks run goes to the ranks: each
    finishes its step, saves and exits 0, and the agent then exits 0 too. A SIGTERM to the whole process group
    (Slurm's scancel, a shell's kill -- -PGID) reached this agent with the ranks, and torchrun's own handler raised:
    exit 1 with its SignalException traceback, the ranks SIGKILLed 30 s later whether their save was done or not.
    Before the ranks exist, and for SIGINT, torchrun's handler (the agent stops them and exits). A SIGTERM that
    comes again once the stopped ranks have exited (a second scancel) is ignored: the agent is returning their 0."""
    from shardwise.launch.local import _children

    ranks = _children(os.getpid()) if signum == signal.SIGTERM else []
    if not ranks and not (signum == signal.SIGTERM and _stopped_ranks):
        _TORCHRUN_HANDLER(signum, frame)
    _stopped_ranks.update(ranks)  # a set: each repeat finds the same ranks
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


_TORCHRUN_HANDLER = multiprocessing_api._terminate_process_handler
_stopped_ranks: set[int] = set()  # the ranks a SIGTERM was passed on to, in this round of them


def _restart_forgets_the_stop(self, worker_group) -> None:
    """torchrun's _restart_workers. The ranks a stop reached failed instead of saving; until the new round runs, a
    SIGTERM is not a repeat of that stop to ignore but one for torchrun (the agent stops and ends)."""
    _stopped_ranks.clear()
    _TORCHRUN_RESTART(self, worker_group)


_TORCHRUN_RESTART = agent_api.SimpleElasticAgent._restart_workers


def _no_restart_that_fails_again(self, worker_group) -> agent_api.RunResult:
    """torchrun's _monitor_workers. A failure every attempt would meet (a config, a checkpoint: restart_cannot_help)
    leaves no restarts: the job ends with its line once, not after --max-restarts more rendezvous and lines."""
    result = _TORCHRUN_MONITOR(self, worker_group)
    if result.is_failed() and restart_cannot_help(result.failures):
        self._remaining_restarts = 0
    return result


_TORCHRUN_MONITOR = LocalElasticAgent._monitor_workers

FAILED_GRACE_S = 5
"""How long torchrun waits for the ranks that outlive a failed one to end after its SIGTERM, before it SIGKILLs
them. Its own wait, 30 s, is time to save, and no save completes without the failed rank. A survivor blocked in a
collective with the dead rank cannot run Python's signal handlers (checkpoint.StopSignal's, or the roll call's) until
the collective times out (train.collective_timeout_s), so it took all 30 s: a rank killed in a job of 4 ended the job,
or started its restart, 30 s late. One that is not blocked ends within a second of the SIGTERM."""


def _close_failed_sooner(self, death_sig, timeout: int = 30) -> None:
    """torchrun's SubprocessContext._close, with FAILED_GRACE_S once a rank has failed."""
    _TORCHRUN_CLOSE(self, death_sig, min(timeout, FAILED_GRACE_S) if self._failures else timeout)


_TORCHRUN_CLOSE = multiprocessing_api.SubprocessContext._close


def main(argv: list[str]) -> int:
    # SIGUSR1 asks the ranks to save and stop (Slurm's warning before the time limit reaches every process of the
    # step, this agent too): the agent lives on until they have. Its workers inherit the "ignore", and each rank's
    # checkpoint.StopSignal handles the signal once it is installed.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # torchrun installs this module global as its handler when it starts the workers (PContext.start)
    multiprocessing_api._terminate_process_handler = _stop_ranks_first
    multiprocessing_api.SubprocessContext._close = _close_failed_sooner
    agent_api.SimpleElasticAgent._restart_workers = _restart_forgets_the_stop
    LocalElasticAgent._monitor_workers = _no_restart_that_fails_again
    args = torchrun.parse_args(argv)
    if args.standalone:  # what torchrun makes of --standalone, for the backend below
        args.standalone = False
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.rdzv_backend == "c10d":
        rendezvous_handler_registry.register(_BACKEND, _c10d_naming_attempts)
        args.rdzv_backend = _BACKEND
    log, held = logging.getLogger(_STOPPING_LOGGER), _HeldBack()
    if args.max_restarts == 0:
        # Without restarts nothing follows these lines but the job's end, so they can wait for its outcome. With
        # restarts they are the live account of each restart, and pass at once.
        log.addFilter(held)
    try:
        # run(), not main(): main's @record only copies the failed rank's error file to torchrun's own, which exists
        # when torchrun itself runs under torchelastic, and otherwise logs an error saying it does not
        torchrun.run(args)
        return 0
    except multiprocessing_api.SignalException as e:
        if e.sigval != signal.SIGINT:
            raise
        # Ctrl-C: torchrun has stopped the ranks, and shardwise's launcher (or, without it, local rank 0) says
        # "shardwise: interrupted" (cli.main); its own
        # traceback of the signal (20 lines after them) said nothing more
        return 128 + signal.SIGINT
    except (RendezvousClosedError, RendezvousConnectionError):
        # the machine that hosts the rendezvous (the first) ended the job, and its log says why; or it never ran it
        print(f"shardwise: error: --rdzv-endpoint: the job's rendezvous at {args.rdzv_endpoint} is closed or gone: "
              "the machine that hosts it ended the job, or is not running it; fix: read that machine's log (the "
              "first machine's: it says why), and start the job there first", file=sys.stderr)
        return 1
    except ChildFailedError as e:
        handed = handed_error(e.failures)
        if handed is None:
            raise
        held.records.clear()  # the failed rank's line says what went wrong; torchrun stopping the others is no news
        rank, code, line = handed
        if rank != 0:  # rank 0 printed its own
            print(line, file=sys.stderr)
        return code
    finally:
        if _stopped_ranks:
            # the ranks stopped as asked and this agent is returning: a repeated SIGTERM (a second scancel) is
            # ignored to the end, as the interpreter puts the default handler back when it finalizes
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        log.removeFilter(held)
        for record in held.records:
            log.handle(record)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
