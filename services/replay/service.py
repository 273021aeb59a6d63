"""The replay service: the experience hub between samplers and the learner.

Samplers (writers) say hello with their segment ring's descriptor, then announce finished
segments by ring index and serial number. Replay copies an announced segment into its
table when the table (and its rate limiter) takes it, then releases the ring slot; until
then the announcement waits here, so the sampler feels back-pressure and nothing accepted
is lost. The learner (reader) says hello with its batch slots and asks for slots to be
filled; a request waits here until the table can serve it.

Data-parallel learners (``learner.count`` ranks) are one reader each. Requests are served in
rounds, once every rank has one waiting: on-policy the round's batch is sampled once and each
rank gets its share of the env columns; off-policy each rank gets a sample of its own (the
rate limiter counts them all), and each sends priorities for its own items. Every rank of a
round gets the same counters (env steps, episodes, observation moments), so all ranks keep
the same books and end the run at the same update.

Peers on another node (``[placement]``) cannot share memory: writers then send each
segment's arrays as frames with its announcement (held here until inserted, then
released as usual), and readers get each batch's arrays as frames with the reply, from
batch slots replay keeps on its heap.

Announcements are idempotent: a writer that timed out resends what it had in flight, and
serial numbers already inserted are released again rather than inserted twice.

Every message goes through ``Endpoint.serve``: a hello must carry the run's secret and
descriptors of the role's own segments; a role (sampler i, the learner) stays bound to the
routing id that said hello until a hello with a newer incarnation comes; values are
checked against the peer's ring and slots. A message that fails is answered with an error
and counted, and the table and what it accepted stay as they were.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path


from services.replay.core import ReplayCore
from shared.transport import shm
from shared.transport.auth import check_secret
from shared.config.schema import ReplayConfig
from shared.replay.kinds import table_kind
from shared.data.namedarraytuple import drop_leading_dims, from_leaves, from_spec, leaves, spec_leading_len, spec_of, validate_spec
from shared.data.batches import column_share
from shared.transport.sockets import Endpoint, Rejected
from shared.runtime import heartbeat
from shared.runtime.files import WriteErrors

log = logging.getLogger(__name__)
POLL_MS = 50


@dataclass
class Writer:
    peer: bytes
    instance: int
    incarnation: int
    segment: object  # None for a writer on another node (its segments come as frames)
    ring: object
    ring_size: int
    last_seen: float
    pending: collections.deque = field(default_factory=collections.deque)  # (body, arrival time, frames' segment)


@dataclass
class Reader:
    peer: bytes
    rank: int
    incarnation: int
    segments: list
    slots: list
    pending: dict = field(default_factory=dict)  # slot -> "sample" body, in request order
    since: dict = field(default_factory=dict)  # slot -> time the request arrived
    checked: set = field(default_factory=set)  # (slot, n) whose layout the table accepted


class ReplayService:
    def __init__(self, cfg: ReplayConfig, table_factory, router: Endpoint, metrics, run_id: str, secret: str,
                 observation_moments: bool = False, snapshot_dir: Path | None = None, ranks: int = 1,
                 remote_writers: bool = False, remote_readers: bool = False):
        """``table_factory(segment_spec)`` makes the table once the first sampler shows its layout;
        ``run_id`` and ``secret`` say which peers and segments belong to the run;
        ``observation_moments``: sum up inserted observations for the learner's normaliser
        (``model.normalize_observations``); ``snapshot_dir``: where to copy the table every
        ``cfg.snapshot_interval_s``; ``ranks``: the learner's data-parallel ranks (module doc);
        ``remote_writers``/``remote_readers``: samplers/learner run on another node (frames)."""
        self.remote_writers, self.remote_readers = remote_writers, remote_readers
        self.snapshot_dir = snapshot_dir
        self.cfg, self.table_factory, self.router, self.m = cfg, table_factory, router, metrics
        self.on_policy = table_kind(cfg.table)[0].on_policy
        self.observation_moments = observation_moments
        self.run_id, self.secret = run_id, secret
        self.core: ReplayCore | None = None  # made with the table, at the first sampler's hello
        self.segment_spec = None
        self.writers: dict[int, Writer] = {}
        self.ranks = ranks
        self.readers: dict[int, Reader] = {}  # by rank
        self.staging = None  # on-policy, several ranks: a round's whole batch, before each rank's columns go out
        self.held: dict[int, tuple[int, int, int]] = {}  # table key -> (writer, incarnation, ring index)
        self.errors = WriteErrors(lambda what: metrics.snapshot_errors.inc())

    @property
    def table(self):
        """The table, None until the first sampler's hello shows the segments' layout."""
        return None if self.core is None else self.core.table

    # ------------------------------------------------------------ messages

    def handle(self, peer: bytes, msg) -> None:
        """One message; raises Rejected (or anything) for ``Endpoint.serve`` to log, count and answer."""
        body = msg.body
        if msg.type == "hello_writer":
            self._hello_writer(peer, body)
        elif msg.type == "segment":
            self._segment(peer, body, msg.arrays)
        elif msg.type == "hello_reader":
            self._hello_reader(peer, body)
        elif msg.type == "priorities":
            self._priorities(peer, body)
        elif msg.type == "sample":
            reader = self._reader_of(peer)
            if not body["slot"] < len(reader.slots):
                raise Rejected("value", f"slot {body['slot']} outside the {len(reader.slots)} batch slots of the hello")
            reader.pending.pop(body["slot"], None)
            reader.pending[body["slot"]] = body
            reader.since[body["slot"]] = time.monotonic()
        else:
            raise Rejected("state", f"replay does not take {msg.type!r} messages")

    def _writer_of(self, peer: bytes) -> Writer:
        for w in self.writers.values():
            if w.peer == peer:
                return w
        raise Rejected("state", "unknown sampler: send hello_writer first")

    def _reader_of(self, peer: bytes) -> Reader:
        for reader in self.readers.values():
            if reader.peer == peer:
                return reader
        raise Rejected("state", "unknown reader: send hello_reader first")

    def _hello_writer(self, peer: bytes, body: dict) -> None:
        check_secret(body, self.secret)
        known = self.writers.get(body["instance"])
        now = time.monotonic()
        if known is not None and known.incarnation == body["incarnation"] and known.peer == peer:
            known.last_seen = now  # the same sampler, saying hello again after a reconnect
            return
        if known is not None and body["incarnation"] <= known.incarnation:
            raise Rejected("auth", f"sampler {body['instance']} is bound to another routing id; a restarted "
                           "sampler must say hello with a newer incarnation")
        try:
            validate_spec(body["ring"].get("spec"), "ring.spec")
            spec = drop_leading_dims(body["ring"].get("spec"), 1)
        except ValueError as e:
            raise Rejected("descriptor", f"bad ring descriptor: {e}") from None
        if not isinstance(spec, dict) or "fields" not in spec:
            raise Rejected("descriptor", "bad ring descriptor: its spec must be an OnPolicyBatch structure")
        if self.segment_spec is not None and spec != self.segment_spec:
            raise Rejected("descriptor", "its segment layout differs from the other samplers' (same config?)")
        try:
            seg, ring = (None, None) if self.remote_writers else \
                shm.attach(body["ring"], shm.Owner(self.run_id, "sampler", body["instance"]))
        except (ValueError, FileNotFoundError) as e:
            raise Rejected("descriptor", f"bad ring descriptor: {e}") from None
        try:
            table = self.table if self.table is not None else self._make_table(spec)
            # ValueError for a sampler the run's config does not have
            last_serial = table.attach_writer(body["instance"], body["incarnation"])
        except ValueError as e:
            _close(seg)
            raise Rejected("value", f"hello_writer: {e}") from None
        except Exception:
            _close(seg)
            raise
        if self.core is None:
            self.core = ReplayCore(table, self.observation_moments, self.m.episodes_dropped.inc)
        self.segment_spec = spec
        if known is not None:
            log.info("sampler %d restarted: dropping %d segment(s) announced by its previous incarnation",
                     known.instance, len(known.pending))
            _close(known.segment)
        self.writers[body["instance"]] = Writer(peer, body["instance"], body["incarnation"], seg, ring,
                                                spec_leading_len(body["ring"]["spec"]), now)
        log.info("sampler %d attached%s", body["instance"],
                 f" (resumes after serial {last_serial})" if last_serial else "")

    def _make_table(self, spec):
        table = self.table_factory(spec)
        heartbeat.phase("serving")  # after a restore from a snapshot, if there was one
        if table.recovered is not None:
            r = table.recovered
            log.warning("replay table re-attached after a restart: %s", json.dumps(r, sort_keys=True))
            self.m.torn_items.inc(r["dropped"])
        self.m.restarts.set(table.arena.restarts)
        return table

    def _segment(self, peer: bytes, body: dict, arrays: list) -> None:
        w = self._writer_of(peer)
        w.last_seen = time.monotonic()
        if not body["index"] < w.ring_size:
            raise Rejected("value", f"segment index {body['index']} outside the ring of {w.ring_size}")
        segment = None
        if w.ring is None:  # a sampler on another node: the segment is in the frames
            try:
                segment = from_leaves(self.segment_spec, arrays)
            except ValueError as e:
                raise Rejected("value", f"segment {body['serial']}'s arrays: {e}") from None
        if body["serial"] <= self.table.last_serial(w.instance):
            self.router.send("release", {"index": body["index"]}, to=peer)  # a resend of what we hold already
            return
        for p, _, _ in w.pending:
            if p["serial"] == body["serial"]:
                return  # a resend of what waits here already
            if p["index"] == body["index"]:
                raise Rejected("value", f"ring slot {body['index']} announced again (serial {body['serial']}) "
                               f"before serial {p['serial']} there was released")
        w.pending.append((body, time.monotonic(), segment))

    def _hello_reader(self, peer: bytes, body: dict) -> None:
        check_secret(body, self.secret)
        rank = body.get("rank", 0)
        if type(rank) is not int or not 0 <= rank < self.ranks:
            raise Rejected("value", f"rank {rank!r:.20} is not one of the run's {self.ranks} learner rank(s)")
        known = self.readers.get(rank)
        if known is not None and known.peer != peer and body["incarnation"] <= known.incarnation:
            raise Rejected("auth", f"learner rank {rank} is bound to another routing id; a restarted learner must "
                           "say hello with a newer incarnation")
        try:
            if self.remote_readers:  # a learner on another node: slots of ours, their arrays go out as frames
                segments, slots = [], [_heap_slot(d) for d in body["slots"]]
            else:
                segments, slots = shm.attach_all(body["slots"], shm.Owner(self.run_id, "learner", rank))
        except (ValueError, FileNotFoundError) as e:
            raise Rejected("descriptor", f"bad batch slot descriptor: {e}") from None
        if known is not None:
            for seg in known.segments:
                seg.close()
        self.readers[rank] = Reader(peer, rank, body["incarnation"], segments, slots)
        log.info("learner%s attached (%d batch slots)", f" rank {rank}" if self.ranks > 1 else "", len(slots))

    def _priorities(self, peer: bytes, body: dict) -> None:
        self._reader_of(peer)
        if self.table is None:
            return
        try:
            applied = self.table.update_priorities(body["keys"], body["generations"], body["priorities"])
        except ValueError as e:
            raise Rejected("value", f"bad priorities: {e}") from None
        self.m.priority_updates.inc(applied)

    # ------------------------------------------------------------ moving data

    def pump(self) -> None:
        """Insert what the table takes, oldest announcement first, then serve what can be sampled.

        Oldest first across writers: serving writers in a fixed order would starve the last
        one whenever the table is the bottleneck, and its segments would go stale.
        """
        while True:
            waiting = [w for w in self.writers.values() if w.pending]
            if not waiting:
                break
            w = min(waiting, key=lambda w: w.pending[0][1])
            if not self.table.can_insert(w.instance):
                break
            body, arrived, segment = w.pending.popleft()
            self.m.blocked.labels(side="sampler").inc(time.monotonic() - arrived)
            self.m.time.to("insert")
            self._insert(w, body, segment)
        if self.table is None:
            return
        self.m.time.to("sample")
        self._serve_rounds()
        self.m.size.set(self.table.size)
        if self.table.selector.prioritized:
            stats = self.table.selector.metrics()
            self.m.priority_max.set(stats["priority_max"])
            self.m.priority_mean.set(stats["priority_alpha_mean"])

    def _serve_rounds(self) -> None:
        """Serve rounds (module doc), each rank's oldest request, while every rank has one."""
        if len(self.readers) < self.ranks:
            return
        readers = [self.readers[rank] for rank in range(self.ranks)]
        while all(reader.pending for reader in readers):
            heads = [(reader, *next(iter(reader.pending.items()))) for reader in readers]  # (reader, slot, body)
            n = heads[0][2]["n"]
            if not all([self._fits(reader, slot, body, n) for reader, slot, body in heads]):
                continue  # the misfit was answered and dropped
            infos = self._sample_round(heads)
            if infos is None:
                break
            meta = self.core.report()
            for (reader, slot, body), info in zip(heads, infos):
                self._reply_sampled(reader, slot, body, info, meta)
            # Ring slots go back to their samplers once the learner has its batch: a sampler
            # woken first takes the CPU the reply's send needs, and where the cores are shared the
            # reply then reaches the learner much later (docs/benchmarks.md, "PPO CartPole: 256 env steps an
            # update").
            if self.on_policy:
                self._release(infos[0]["keys"])  # once for the round, however many ranks share it

    def _sample_round(self, heads: list) -> list | None:
        """Fill every head's slot (one round); the sample info per rank, or None if the table
        cannot serve the round now. The round's lag bound is rank 0's request's."""
        n, min_version = heads[0][2]["n"], heads[0][2]["min_version"]
        if self.ranks == 1 or self.on_policy:
            dest = heads[0][0].slots[heads[0][1]] if self.ranks == 1 else self._staging(n)
            info, dropped = self.core.sample(dest, n, min_version, lag_bound=self.on_policy)
            self._release(dropped)
            self.m.dropped.inc(len(dropped))
            if info is None:
                return None
            if self.ranks > 1:
                for reader, slot, _ in heads:
                    reader.slots[slot][:] = column_share(self.staging, reader.rank, self.ranks)
            return [info] * self.ranks
        if not self.table.can_sample(n * self.ranks):
            return None
        return [self.table.sample_into(reader.slots[slot], n) for reader, slot, _ in heads]

    def _fits(self, reader: Reader, slot: int, body: dict, n: int) -> bool:
        """Whether the table can write ``n`` items, what the round's rank 0 asks for, into the
        reader's ``slot`` (on-policy with several ranks: its share of a batch of n segments);
        if not the request is answered with an error and dropped (checked once per slot and n)."""
        try:
            if body["n"] != n:
                raise ValueError(f"the ranks of a round ask for the same number of items (rank 0: {n})")
            if (slot, n) not in reader.checked:
                if self.ranks > 1 and self.on_policy:
                    self._check_share(reader.slots[slot], n)
                else:
                    self.table.storage.check_dest(reader.slots[slot], n)
        except (ValueError, AttributeError, TypeError) as e:
            del reader.pending[slot]
            reader.since.pop(slot)
            log.warning("sample request for slot %d of %d items rejected: %s", slot, body["n"], e)
            self.router.reject(reader.peer, "sample", "descriptor", f"batch slot {slot} cannot hold {body['n']} items: {e}")
            return False
        reader.checked.add((slot, n))
        return True

    def _staging(self, n: int):
        """The round's whole on-policy batch of ``n`` segments (several ranks)."""
        if self.staging is None or self.staging.bootstrap_value.shape[0] != n * self.table.storage.B:
            self.staging = from_spec(self.table.storage.batch_spec(n), fill=False)
        return self.staging

    def _check_share(self, dest, n: int) -> None:
        """ValueError unless ``dest`` is laid out as one rank's share of a batch of ``n`` segments."""
        want = spec_of(column_share(self._staging(n), 0, self.ranks))
        if spec_of(dest) != want:
            raise ValueError(f"a rank's share of {n} segments is laid out as {want}")

    def _insert(self, w: Writer, body: dict, segment) -> None:
        """``segment``: the arrays that came as frames, or None: the writer's ring slot."""
        if segment is None:
            segment = w.ring[body["index"]]
        keys = self.core.insert(w.instance, segment, body["steps"], body["episodes"], serial=body["serial"])
        if self.cfg.release_on_sample and self.on_policy:
            for key in keys:
                self.held[int(key)] = (w.instance, w.incarnation, body["index"])
        else:
            self.router.send("release", {"index": body["index"]}, to=w.peer)
        self.m.inserts.inc()
        self.m.insert_steps.inc(body["steps"])

    def _reply_sampled(self, reader: Reader, slot: int, body: dict, info: dict, meta: dict) -> None:
        del reader.pending[slot]
        waited = time.monotonic() - reader.since.pop(slot)
        self.m.blocked.labels(side="learner").inc(waited)
        self.m.samples.inc(body["n"])
        reply = {"slot": slot, "n": body["n"], **meta}
        reply.update({name: keys.tolist() for name, keys in self.core.priority_keys(info).items()})
        # On another node the batch goes as frames (zero-copy: the slot is not filled again
        # before the learner, having received this, asks for it again).
        arrays = [leaf for _, leaf in leaves(reader.slots[slot])] if self.remote_readers else None
        self.router.send("sampled", reply, arrays=arrays, to=reader.peer)

    def _release(self, keys) -> None:
        """Give held ring slots back to their samplers (release_on_sample)."""
        for key in keys:
            held = self.held.pop(int(key), None)
            if held is None:
                continue
            w = self.writers.get(held[0])
            if w is not None and w.incarnation == held[1]:
                self.router.send("release", {"index": held[2]}, to=w.peer)

    def check_peers(self) -> None:
        """Forget samplers silent past the timeout that are not waiting on us."""
        now = time.monotonic()
        for instance, w in list(self.writers.items()):
            if not w.pending and now - w.last_seen > self.cfg.peer_timeout_s:
                log.warning("sampler %d silent for %.1f s: reported lost", instance, now - w.last_seen)
                self.m.peers_lost.inc()
                _close(w.segment)
                del self.writers[instance]

    def snapshot(self) -> None:
        """Copy the table to the snapshot directory (between operations: the loop calls it)."""
        t0 = time.monotonic()
        heartbeat.phase("writing a table snapshot")
        try:
            self.table.arena.snapshot(self.snapshot_dir)
        except OSError as e:  # a full disk: the table and the previous snapshot stay, the next interval tries again
            self.errors.failed("table snapshot", e)
            return
        finally:
            heartbeat.phase("serving")
        self.errors.ok("table snapshot")
        log.info("table snapshot (%d items) written to %s in %.2f s", self.table.size, self.snapshot_dir,
                 time.monotonic() - t0)

    def run(self, should_stop=lambda: False) -> None:
        last_check = last_snapshot = time.monotonic()
        every = self.cfg.snapshot_interval_s
        heartbeat.phase("serving")
        while not should_stop():
            heartbeat.beat()
            self.m.time.to("idle")
            item = self.router.recv(POLL_MS)
            self.m.time.to("messages")
            if item is not None:
                self.router.serve(self.handle, *item)
                for peer, msg in self.router.drain():
                    self.router.serve(self.handle, peer, msg)
            self.pump()
            now = time.monotonic()
            if now - last_check > 1.0:
                self.check_peers()
                last_check = now
            if every and self.table is not None and now - last_snapshot > every:
                self.m.time.to("snapshot")
                self.snapshot()
                last_snapshot = now

    def close(self) -> None:
        for w in self.writers.values():
            _close(w.segment)
        for reader in self.readers.values():
            for seg in reader.segments:
                seg.close()


def _close(segment) -> None:
    if segment is not None:  # None: a writer on another node
        segment.close()


def _heap_slot(descriptor: dict):
    """A batch slot of replay's own for a learner on another node, laid out as its descriptor says."""
    spec = descriptor.get("spec") if isinstance(descriptor, dict) else None
    validate_spec(spec, "batch slot spec")
    return from_spec(spec, fill=False)
