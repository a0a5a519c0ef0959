"""The syncer's lease: one publishing syncer per run at a time, each with its own epoch.

On a cluster the syncer is a pod Argo retries, and a retried pod can start while the old one still runs; two
syncers would then publish the same version numbers with different contents. The lease makes the second
stand by, take over once the first stops renewing, and fences the first. An epoch is a write-once claim
(`Store.create`: of racing claimers exactly one wins); its holder rewrites its renewal from a thread while
the loop makes progress, and a standby takes over when a renewal has not changed for `lease_s` on its own
monotonic clock, never comparing two hosts' wall clocks. Before each publish `check` raises `Fenced` if a
newer epoch exists, and write-once objects back that up. A fenced syncer exits with `FENCED_EXIT` (3).

Design notes (keys, expiry, the lease's length and its trade-off): docs/internals.md, "The lease: one
publishing syncer".
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from ddiloco import keys
from ddiloco.config.lease import LeaseConfig
from ddiloco.platform.hostname import host_name
from ddiloco.protocol.messages import Standby
from ddiloco.store.base import Store, StoreError

log = logging.getLogger(__name__)

FENCED_EXIT = 3
"""Exit code of a syncer that found a newer epoch than its own."""
_LATENCY_EMA = 0.3


class Fenced(RuntimeError):
    """Another syncer holds a newer epoch, or published the version this one was about to write."""


class Lease:
    """One syncer process's side of the lease (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        cfg: LeaseConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        keep_renewing: bool = True,
    ) -> None:
        """`keep_renewing`: renew from a thread once held; False leaves it to the caller (`renew_if_due`
        once per loop pass, `check` before a publish): in-process syncers and tests that drive `clock`."""
        self.store, self.run_id = store, run_id
        self.keep_renewing = keep_renewing
        self.cfg = cfg if cfg is not None else LeaseConfig()
        self.clock, self.wall, self.sleep = clock, wall, sleep
        self.nonce = secrets.token_hex(8)
        self.epoch = 0
        """The epoch this process holds; 0 while it holds none."""
        self.lease_s = self.cfg.min_s
        self.publish_s = 0.0
        """The holder's merge-and-publish time (ξ_sync), set by `check`: part of the lease and its guard."""
        self.fenced_by: int | None = None
        self._released = False
        self._latency_s = 0.0
        self._seq = 0
        self._valid_until = -math.inf
        self._renewed_at = -math.inf
        self._seen: tuple[tuple[int, int], float, float] | None = None  # (epoch, seq), first read, lease_s
        self._standbys: list[Standby] = []
        self._pass_at: float | None = None
        """When the syncer's loop last made a pass (`renew_if_due`); None before its first."""
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the lease's length ---------------------------------------------------------------------------------
    def derive(self) -> float:
        c = self.cfg
        return max(c.min_s, c.factor * (c.renew_every_s + self._latency_s + self.publish_s))

    def _timed(self, op: Callable[[], Any]) -> Any:
        start = self.clock()
        out = op()
        took = self.clock() - start
        self._latency_s = (
            took if self._latency_s == 0 else _LATENCY_EMA * took + (1 - _LATENCY_EMA) * self._latency_s
        )
        return out

    # --- taking it --------------------------------------------------------------------------------------------
    def latest_epoch(self) -> int:
        """The newest claimed epoch (0: none yet)."""
        listed = self._timed(lambda: self.store.list(keys.lease_claim_prefix()))
        return max((e for e in map(keys.lease_epoch_of, listed) if e is not None), default=0)

    def acquire(self, done: Callable[[], bool] = lambda: False) -> bool:
        """Stand by until the lease is free, then take it (True); False if `done()` turned true first."""
        announced = False
        while True:
            try:
                if self.try_take():
                    return self._leave_standby(True)
                if done():
                    return self._leave_standby(False)
                if not announced:
                    announced = True
                    self._log_standing_by()
                self._announce()
            except StoreError as e:  # a standby rides out an outage like everyone else
                log.warning("syncer standby: store error (%s); still standing by", e)
                self._seen = None  # the holder could not renew either: its silence counts from the next read
            self.sleep(self.cfg.renew_every_s / 2)

    def _leave_standby(self, taken: bool) -> bool:
        try:  # a leftover announcement only shows in the status for a while: not worth failing over
            self.store.delete(keys.lease_standby_key(self.nonce))
        except StoreError as e:
            log.warning("syncer: could not delete the standby announcement (%s)", e)
        return taken

    def try_take(self) -> bool:
        """One standby poll: take the lease if it is free, released or expired (True when taken)."""
        latest = self.latest_epoch()
        if latest == 0:
            return self._claim(1)
        renewal = self._renewal(latest)
        if renewal.get("released"):
            return self._claim(latest + 1, f"epoch {latest} released the lease")
        now, seen = self.clock(), (latest, int(renewal["seq"]))
        if self._seen is None or self._seen[0] != seen:
            self._seen = (seen, now, float(renewal["lease_s"]))
            return False
        if now - self._seen[1] < self._seen[2]:
            return False
        why = f"epoch {latest} did not renew for {now - self._seen[1]:.1f}s (lease {self._seen[2]:.1f}s)"
        return self._claim(latest + 1, why)

    def seize(self) -> None:
        """Take the next epoch at once, fencing whoever holds the lease: for a process that knows the holder
        is gone, and for in-process syncers (tests). `ddiloco syncer` stands by instead (`acquire`)."""
        while not self._claim(self.latest_epoch() + 1, "seized"):
            pass

    @classmethod
    def seized(cls, store: Store, run_id: str, cfg: LeaseConfig) -> Lease:
        """A lease of the next epoch, seized now and renewed by its caller (`renew_if_due`), no thread: what
        an in-process syncer holds; an abandoned one leaves nothing running behind."""
        lease = cls(store, run_id, cfg, keep_renewing=False)
        lease.seize()
        return lease

    def _claim(self, epoch: int, why: str = "no syncer held it") -> bool:
        start = self.clock()
        lease_s = self.derive()
        doc = {
            "run_id": self.run_id,
            "epoch": epoch,
            "seq": 0,
            "lease_s": lease_s,
            "time": self.wall(),
            "host": host_name(),
            "pid": os.getpid(),
            "nonce": self.nonce,
        }
        if not self.store.create_json(keys.lease_claim_key(epoch), doc):
            return False  # another syncer claimed it first: watch that one
        with self._lock:
            self.epoch, self._seq, self.lease_s = epoch, 0, lease_s
            self._valid_until, self._renewed_at = start + lease_s, start
        log.info(
            "syncer: took the lease of run %s as epoch %d (%s; lease %.1fs)", self.run_id, epoch, why, lease_s
        )
        if self.keep_renewing:
            self._thread = threading.Thread(target=self._keep, name=f"lease-{epoch}", daemon=True)
            self._thread.start()
        return True

    def _renewal(self, epoch: int) -> dict[str, Any]:
        """The newest renewal of `epoch`; its claim (seq 0) before the first renewal."""
        doc = self._timed(lambda: self.store.get_json_or_none(keys.lease_renewal_key(epoch)))
        return doc if doc is not None else self.store.get_json(keys.lease_claim_key(epoch))

    def _log_standing_by(self) -> None:
        latest = self.latest_epoch()
        holder = self.store.get_json_or_none(keys.lease_claim_key(latest)) or {}
        log.info(
            "syncer: standing by: epoch %d (host %s, pid %s) holds the lease of run %s; taking over if it "
            "stops renewing for %.1fs",
            latest,
            holder.get("host", "?"),
            holder.get("pid", "?"),
            self.run_id,
            self._seen[2] if self._seen else self.cfg.min_s,
        )

    def _announce(self) -> None:
        seen = self._seen[0][0] if self._seen else 0
        doc = {"host": host_name(), "pid": os.getpid(), "nonce": self.nonce, "watching": seen}
        self.store.put_json(keys.lease_standby_key(self.nonce), doc | {"time": self.wall()})

    # --- holding it -----------------------------------------------------------------------------------------
    def renew(self) -> None:
        """Write the next renewal; `Fenced` if a newer epoch is claimed (StoreError: try again later)."""
        with self._lock:
            self._raise_if_fenced()
            start = self.clock()
            lease_s = self.derive()
            doc = {"epoch": self.epoch, "seq": self._seq + 1, "lease_s": lease_s, "time": self.wall()}
            self._timed(lambda: self.store.put_json(keys.lease_renewal_key(self.epoch), doc))
            self._seq += 1
            if self.store.exists(keys.lease_claim_key(self.epoch + 1)):
                self.fenced_by = self.epoch + 1
                self._raise_if_fenced()
            self.lease_s, self._valid_until, self._renewed_at = lease_s, start + lease_s, start

    def renew_if_due(self) -> None:
        """Once per pass of the syncer's loop: renew when `renew_every_s` has passed since the last renewal,
        unless a thread does it (which then knows the loop is alive)."""
        self._pass_at = self.clock()
        if not self.keep_renewing and self.clock() - self._renewed_at >= self.cfg.renew_every_s:
            self.renew()

    def loop_stuck(self) -> float | None:
        """Seconds since the loop's last pass when that exceeds `stuck_s`, else None."""
        if self._pass_at is None:
            return None  # still resuming: the lease was taken just before
        idle = self.clock() - self._pass_at
        return idle if idle > self.cfg.stuck_s else None

    def check(self, publish_s: float = 0.0) -> None:
        """Before a publish: `Fenced` if this syncer no longer holds the newest epoch; renews first when less
        than `publish_s` (the publish about to start) is left of the lease."""
        with self._lock:
            self.publish_s = publish_s
            self._raise_if_fenced()
            if self.clock() + publish_s >= self._valid_until:
                self.renew()
            elif self.store.exists(keys.lease_claim_key(self.epoch + 1)):
                self.fenced_by = self.epoch + 1
                self._raise_if_fenced()

    def _raise_if_fenced(self) -> None:
        if self.epoch == 0:
            raise Fenced("this syncer holds no lease")
        if self.fenced_by is not None:
            raise Fenced(f"syncer epoch {self.fenced_by} took over from epoch {self.epoch}")
        if self._released:
            raise Fenced(f"epoch {self.epoch} released the lease")

    def raise_if_fenced(self) -> None:
        """No I/O: what the renewal thread or the last check found."""
        with self._lock:
            self._raise_if_fenced()

    def _keep(self) -> None:
        """The renewal thread: renew every `renew_every_s` until released or fenced."""
        stuck_logged = False
        while not self._stop.wait(self.cfg.renew_every_s):
            idle = self.loop_stuck()
            if idle is not None:  # a hung syncer lets its lease lapse; a standby takes over
                if not stuck_logged:
                    log.error(
                        "syncer: the loop made no pass for %.0f s (lease.stuck_s=%s); renewals stop so a "
                        "standby can take over; this syncer is fenced if it wakes up",
                        idle,
                        self.cfg.stuck_s,
                    )
                    stuck_logged = True
                continue
            stuck_logged = False
            try:
                self.renew()
                self._standbys = self._read_standbys()
            except Fenced as e:
                log.error("syncer: lost the lease (%s); no more publishing", e)
                return
            except StoreError as e:
                log.warning("syncer: lease renewal failed (%s); retrying", e)

    def _read_standbys(self) -> list[Standby]:
        """Announcements younger than 3 leases (a SIGKILLed standby leaves its own behind); wall clocks of
        two hosts are compared here, which is fine for a display."""
        out = []
        for k in self.store.list(keys.lease_standby_prefix()):
            try:
                standby = Standby.from_json(self.store.get_json_or_none(k, max_bytes=4096))
            except (ValueError, StoreError) as e:
                log.warning("syncer: ignoring standby announcement %s (%s)", k, e)
                continue
            if standby.time > self.wall() - 3 * self.lease_s:
                out.append(standby)
        return out

    def standbys(self) -> list[Standby]:
        """The standbys seen at the last renewal."""
        return list(self._standbys)

    def release(self) -> None:
        """Stop renewing and, if this syncer still holds the newest epoch, say so: a standby takes over now."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        with self._lock:
            if self.epoch == 0 or self.fenced_by is not None or self._released:
                return
            self._released = True
            doc = {"epoch": self.epoch, "seq": self._seq + 1, "lease_s": self.lease_s, "time": self.wall()}
            try:
                self.store.put_json(keys.lease_renewal_key(self.epoch), doc | {"released": True})
            except StoreError as e:
                log.warning("syncer: could not release the lease (%s); a standby waits it out", e)
