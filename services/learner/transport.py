"""The learner's sockets: batches from replay (DEALER) and parameter versions out (PUB)."""

from __future__ import annotations

import logging
import time

import zmq

from shared.runtime.metrics import bad_message_counter
from shared.data.namedarraytuple import from_leaves, spec_of
from shared.transport.params import ParamWriter
from shared.transport.sockets import Endpoint

log = logging.getLogger(__name__)


class RemoteBatches:
    """BatchSource over a DEALER socket to replay; slots are shared-memory descriptors. With
    ``frames`` (the learner's batch slots; replay runs on another node) each batch comes as
    the reply's frames and is copied into its slot here.

    An ``error`` reply (replay refused our hello, a request or a priority update) makes the
    learner say hello again and ask again, after ``REFUSAL_BACKOFF_S`` doubling up to 8 s: a
    refusal comes at once, and answering it at once would spin. ``MAX_REFUSALS`` errors in a
    row with no batch between them are a RuntimeError with replay's last reason (supervisord
    restarts the learner). Silence is not a refusal: a table still filling answers nothing."""

    REFUSAL_BACKOFF_S = 0.1
    MAX_REFUSALS = 12

    def __init__(self, ctx: zmq.Context, address: str, slot_descriptors: list, batch_items: int, timeout_ms: int,
                 metrics, secret: str, rank: int = 0, frames: list | None = None):
        self.ep = Endpoint(ctx, zmq.DEALER, address, bind=False, name=f"learner{rank}",
                           on_bad=bad_message_counter(metrics))
        self.batch_items, self.timeout_ms, self.frames = batch_items, timeout_ms, frames
        self.frame_specs = None if frames is None else [spec_of(slot) for slot in frames]
        self.hello = {"slots": slot_descriptors, "incarnation": time.time_ns(), "secret": secret, "rank": rank}
        self.outstanding: dict[int, int] = {}  # slot -> min_version asked
        self.t_last = time.monotonic()
        self.refusals = 0  # error replies since the last batch
        self.ep.send("hello_reader", self.hello)

    def request(self, slot: int, min_version: int) -> None:
        self.outstanding[slot] = min_version
        self.ep.send("sample", {"slot": slot, "n": self.batch_items, "min_version": min_version})

    def next(self, timeout_ms: int):
        reply = self.ep.recv(timeout_ms)
        if reply is None:
            if time.monotonic() - self.t_last > self.timeout_ms / 1000.0:
                log.warning("no batch from replay at %s for %.1f s; reconnecting", self.ep.address,
                            time.monotonic() - self.t_last)
                self._recover()
            return None
        msg = reply[1]
        self.t_last = time.monotonic()
        if msg.type == "sampled" and msg.body["slot"] in self.outstanding:
            if self.frames is not None and not self._take_frames(msg):
                return None  # asked again: replay serves the request anew
            del self.outstanding[msg.body["slot"]]
            self.refusals = 0
            return msg.body["slot"], msg.body
        if msg.type == "error":
            self.refusals += 1
            if self.refusals >= self.MAX_REFUSALS:
                raise RuntimeError(f"replay at {self.ep.address} refused us {self.refusals} times in a row, last: "
                                   f"{msg.body['reason']}; giving up")
            log.warning("replay says: %s (refusal %d in a row; asking again)", msg.body["reason"], self.refusals)
            time.sleep(min(self.REFUSAL_BACKOFF_S * 2 ** (self.refusals - 1), 8.0))
            self._recover()
        return None

    def _take_frames(self, msg) -> bool:
        """Copy the batch that came as frames into its slot; False (logged, counted, asked
        again) if the arrays do not fit the slot."""
        try:
            batch = from_leaves(self.frame_specs[msg.body["slot"]], msg.arrays)
        except ValueError as e:
            log.warning("batch for slot %d does not fit it (%s); asking again", msg.body["slot"], e)
            self.ep.on_bad("value")
            self.request(msg.body["slot"], self.outstanding[msg.body["slot"]])
            return False
        self.frames[msg.body["slot"]][:] = batch
        return True

    def update_priorities(self, meta: dict, priorities) -> None:
        self.ep.send("priorities", {"keys": meta["keys"], "generations": meta["generations"],
                                    "priorities": [float(p) for p in priorities]})

    def _recover(self) -> None:
        self.t_last = time.monotonic()
        self.ep.reconnect()
        self.ep.send("hello_reader", self.hello)
        for slot, min_version in sorted(self.outstanding.items()):
            self.ep.send("sample", {"slot": slot, "n": self.batch_items, "min_version": min_version})

    def close(self) -> None:
        self.ep.close()


class PublishedParams:
    """ParamSink: writes the agent's state into shared memory, then announces the version;
    with ``frames`` (a consumer on another node) the state's arrays follow as ``params_data``."""

    def __init__(self, ctx: zmq.Context, address: str, writer: ParamWriter, frames: bool = False):
        self.writer, self.frames = writer, frames
        self.ep = Endpoint(ctx, zmq.PUB, address, bind=True, name="learner0")

    def publish(self, version: int, env_steps: int) -> None:
        self.writer.write(version, env_steps)
        self.ep.send("params", {"version": version, "segment": self.writer.descriptor, "env_steps": env_steps})
        if self.frames:  # copies: the parameters change under a zero-copy send at the next update
            arrays = [t.detach().cpu().numpy().copy() for t in self.writer.module.state_dict().values()]
            self.ep.send("params_data", {"version": version, "env_steps": env_steps}, arrays=arrays)

    def close(self) -> None:
        self.ep.close()
        self.writer.close()


class Unpublished:
    """ParamSink of the ranks other than 0: rank 0 publishes the group's (identical) parameters."""

    def publish(self, version: int, env_steps: int) -> None:
        pass

    def close(self) -> None:
        pass
