"""The end of a Checkpointer: ``close()``, interpreter exit and SIGTERM.

``close()`` stops the writer once it has written what is queued, lets due promotions finish,
fails the retries that can no longer run, and releases threads and the roots' writer
leases; each step may be repeated (a close() interrupted by Ctrl-C is finished by the next
one, or at exit). ``gpusnap.exit_hooks`` tracks the save path (``Saves``: what pending
work keeps alive), whose ``at_exit`` and ``at_signal`` come here.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref

from gpusnap.distributed.collective import Collective
from gpusnap.errors import CheckpointError
from gpusnap.restore.restorer import Restorer
from gpusnap.save.saves import RETRY_POLL_S, Saves

__all__ = ["Lifecycle"]


class Lifecycle:
    def __init__(self, saves: Saves, restorer: Restorer, collective: Collective | None) -> None:
        # (weakly: the save path holds this, and must not be kept in a reference cycle)
        self._saves = weakref.ref(saves)
        self._restorer = restorer
        self._collective = collective
        self.root = saves.tiers.root
        self.stopped = False  # close() has finished: threads released
        self._close_lock = threading.Lock()  # a second close() waits for the first

    @property
    def saves(self) -> Saves:
        saves = self._saves()
        assert saves is not None, "the Checkpointer holds its save path while it holds this"
        return saves

    @property
    def closed(self) -> bool:
        return self.saves.engine.closed

    def check_process(self) -> None:
        if os.getpid() != self.saves.pid:  # (its threads, lease and pending saves are the parent's)
            raise CheckpointError(
                f"Checkpointer({self.root!r}) was made in process {self.saves.pid}, which this process was forked "
                "from: make a new Checkpointer in this process (a DataLoader worker should not save)"
            )

    def check_open(self) -> None:
        self.check_process()
        if self.closed:
            self.saves.reap(retry=False)  # a close() on another thread left this thread's tracker
            raise CheckpointError(f"Checkpointer({self.root!r}) is closed")

    def in_child(self) -> bool:
        """A forked child: the threads and saves are the parent's."""
        return os.getpid() != self.saves.pid

    def close(self) -> None:
        """close(): shut down, then raise what failed unobserved (once)."""
        if self.in_child():
            self.saves.engine.closed = self.stopped = True
            return
        self.shut_down()
        self.saves.unobserved.raise_if_any("Checkpointer.close()")
        self.saves.tiers.raise_promotion_failures()

    def shut_down(self) -> None:
        """close() without raising; each step may be repeated."""
        saves = self.saves
        with self._close_lock:
            if self.stopped:  # (by another thread, maybe: this one's tracker may be left)
                saves.reap(retry=False)
                return
            saves.reap()  # a retry due on this thread starts before the writer stops
            saves.stop()
            self._newest_durable()
            promoter = saves.tiers.promoter
            if promoter is not None:
                promoter.retry_failed()  # (a promotion that failed gets one more try first)
                promoter.stop()  # what is due is promoted before the roots are let go
            saves.reap(retry=False)
            saves.fail_late_retries()
            self._restorer.close()
            saves.planner.join_warmup()  # (never used by a save: not left loading at exit)
            saves.release_threads()
            saves.tiers.close()  # the writer leases: another Checkpointer may write now
            if self._collective is not None:
                self._collective.close()
            self.stopped = True

    def _newest_durable(self) -> None:
        """The memory tier's newest checkpoint reaches the root before the process ends."""
        try:
            self.saves.tiers.newest_not_durable()
        except Exception as exc:  # (its checkpoints stay in the memory tier: say so)
            print(f"gpusnap: the newest checkpoint in the memory tier of {self.root} could not be made durable: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    def at_exit(self, final: bool) -> None:
        """Interpreter exit: finish the pending saves (``final``: close), then report on
        stderr each failure nothing observed, and any save that could not finish."""
        saves = self.saves
        try:
            if final:
                self.shut_down()
            elif not self.closed:
                for p in saves.pending():
                    saves.wait_for(p, None)
                self._newest_durable()
                if saves.tiers.promoter is not None:  # (while the interpreter still starts threads)
                    saves.tiers.promoter.wait()
        except BaseException as exc:  # an exit hook must not raise; say what is lost
            lost = [p.id for p in saves.pending() if not p.done()]
            print(f"gpusnap: at exit, the saves pending under {self.root} could not finish "
                  f"({type(exc).__name__}: {exc}); lost: {', '.join(lost) or 'none'}", file=sys.stderr, flush=True)
        saves.unobserved.report(self.root)
        if final:
            saves.tiers.report_promotion_failures("at exit")

    def at_signal(self, deadline: float) -> None:
        """SIGTERM: wait until ``deadline`` (time.monotonic) for the pending saves, then the
        promotions; name on stderr what did not finish. Runs in a signal handler on the main
        thread, which may have been inside the save path: it starts nothing (no retry, no
        close) and only waits, bounded."""
        saves = self.saves
        pending = saves.pending()
        for p in pending:
            while not p.done() and time.monotonic() < deadline:
                p.wait_done(min(RETRY_POLL_S, max(0.0, deadline - time.monotonic())))
        promoter = saves.tiers.promoter
        if promoter is not None:
            promoter.wait(max(0.0, deadline - time.monotonic()))
        lost = [p.id for p in pending if not p.done()]
        lost += promoter.pending_ids() if promoter is not None else []
        tiers = saves.tiers
        if tiers.implicit and tiers.promote_every not in (None, 1):  # (nothing is started here: see above)
            print(f"gpusnap: SIGTERM: checkpoints saved since the last promotion stay in the memory tier "
                  f"{tiers.fast_root} (promote_every={tiers.promote_every}), not in {self.root}; the next "
                  "Checkpointer of that root makes the newest durable", file=sys.stderr, flush=True)
        if lost:
            print(f"gpusnap: SIGTERM: saves or promotions under {self.root} did not finish within "
                  f"Config.sigterm_grace_s ({saves.config.sigterm_grace_s} s); lost: {', '.join(lost)}",
                  file=sys.stderr, flush=True)
        saves.unobserved.report(self.root)
        saves.tiers.report_promotion_failures("on SIGTERM")
