"""Multi-host replicas: the lead schedules, every host runs the same step, in lockstep.

A replica that spans several hosts is multi-controller SPMD: every host runs the same program on
the same inputs. The lead ``HostActor`` owns the only scheduler that matters; each step it sends
the ``SchedulerOutput`` (plain data) to every ``FollowerHost``, runs the step itself, and then
checks that each follower sampled exactly the tokens it did. Tokens reach clients from the lead
only; the followers' results exist to prove they are still in step.

A follower that differs, raises, dies or stops answering fails the whole replica with a
``HostError`` on every stream: a replica whose hosts disagree is producing garbage (on a TPU slice
its collectives would hang or mix different steps), so it must never carry on quietly.

What each host computes differs by machine. On CPU hosts every host runs the whole model on its
own copy of the weights and KV cache, so the replica is no faster than one host: the lockstep is
real, the parallelism is not. On a TPU slice, torch_xla's multi-host SPMD runs one program over
all the slice's chips; each host's process feeds the same inputs and the collectives between its
chips and the other hosts' do the splitting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from meshserve.actors.engine_host import EngineHost
from meshserve.actors.messages import HostError, HostInfo
from meshserve.contracts.step import RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from meshserve.engine.engine import EngineCore

# How long the lead waits for a follower's step. Serving steps take milliseconds to seconds
# (warm-up compiled everything before serving began); a follower this late is lost.
STEP_TIMEOUT_S = 300.0


class FollowerHost(EngineHost):
    """A non-lead host of a multi-host replica: it holds an engine and runs the lead's steps.

    It never schedules and never talks to clients. Its one method that matters, ``execute``, is
    called by the lead, in order (a plain actor runs one call at a time, in submission order).
    """

    def execute(self, step: SchedulerOutput) -> dict[str, int]:
        """Run one step; return the sampled token ids for the lead to compare with its own."""
        return self.engine.execute(step).sampled_token_ids


class Lockstep:
    """The lead's side: broadcast a step, run it locally, check every follower agrees."""

    def __init__(self, followers: Sequence) -> None:
        self.followers = list(followers)
        self.num_steps = 0

    def execute(self, engine: EngineCore, step: SchedulerOutput) -> RunnerOutput:
        import ray

        # Followers start on the step while the lead runs it: the hosts work in parallel.
        refs = [f.execute.remote(step) for f in self.followers]
        output = engine.execute(step)
        self.num_steps += 1
        for index, ref in enumerate(refs, start=1):
            try:
                theirs = ray.get(ref, timeout=STEP_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise HostError(f"host {index} did not finish step {self.num_steps} within "
                                f"{STEP_TIMEOUT_S:.0f}s; the replica is out of step") from None
            except ray.exceptions.RayError as exc:
                raise HostError(f"host {index} failed at step {self.num_steps}; the replica is "
                                f"out of step: {exc}") from None
            ours = output.sampled_token_ids
            if theirs != ours:
                request_id = next(r for r in sorted(set(theirs) | set(ours))
                                  if theirs.get(r) != ours.get(r))
                raise HostError(f"host {index} fell out of step at step {self.num_steps}: it "
                                f"sampled {theirs.get(request_id)} for request {request_id!r} "
                                f"where the lead sampled {ours.get(request_id)}")
        return output


def check_agreement(infos: Sequence[HostInfo]) -> None:
    """Every host of a replica must hold the same cache shape: the steps name block ids."""
    lead = infos[0]
    for info in infos[1:]:
        if (info.num_total_blocks, info.max_model_len) != (lead.num_total_blocks,
                                                           lead.max_model_len):
            raise HostError(
                f"hosts of one replica sized their KV caches differently: host 0 has "
                f"{lead.num_total_blocks} blocks and max_model_len {lead.max_model_len}, host "
                f"{info.host_index} has {info.num_total_blocks} and {info.max_model_len}; set "
                f"num_kv_blocks (and max_model_len) so every host allocates the same cache")
