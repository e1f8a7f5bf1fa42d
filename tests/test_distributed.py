"""Serving across hosts on a local Ray cluster whose every socket is on 127.0.0.1.

One cluster for the module: a head and two workers stand for three CPU hosts; a simulated
two-host TPU slice (nodes carrying the TPU environment variables Ray reads, ``{"TPU": 4}`` each)
joins for the TPU tests at the end. There is no TPU here: the "TPU" hosts run the engine with
``device="cpu"``; what the slice tests check is Ray's placement and the lockstep, not TPU maths.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import uuid
from dataclasses import dataclass

import httpx
import psutil
import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from meshserve import LLM, SamplingParams
from meshserve.actors import (Completion, FollowerHost, GenerateSpec, HostError, HostInfo,
                              place_hosts, start_host, start_replica, start_replicas)
from meshserve.actors.lockstep import check_agreement
from meshserve.actors.messages import ServerDraining
from meshserve.actors.placement import TpuSliceShape, tpu_slice_shape
from meshserve.deploy.app import build_app
from meshserve.deploy.client import EngineClient, replica_lost
from meshserve.deploy.load import ReplicaGone
from meshserve.deploy.settings import ServeSettings
from tests.local_cluster import tpu_nodes
from tests.server import free_port
from tests.sse import DONE, sse_events

# Everything that starts the cluster is slow; the few checks of plain data are not.
slow = pytest.mark.slow

# Small on purpose: every host allocates this cache, and the engines are compared token by token.
ENGINE_ARGS = dict(device="cpu", block_size=16, num_kv_blocks=64, max_model_len=256,
                   max_num_seqs=8, max_num_batched_tokens=256)
GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPTS = [
    "The capital of France is", "Once upon a time", "def fibonacci(n):", "Rain in Spain",
    "The quick brown fox", "In 1492, Columbus", "My favourite colour is", "Water boils at",
    "A haiku about the sea:",
]
TPU_SLICE = dict(TPU_NAME="test-slice", TPU_ACCELERATOR_TYPE="v4-16", TPU_TOPOLOGY="2x2x2")


def _settings(model: str, **overrides) -> ServeSettings:
    return ServeSettings.from_args({"model": model, **ENGINE_ARGS, **overrides})


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=2, node_ip_address="127.0.0.1", include_dashboard=False))
    workers = [cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1") for _ in range(2)]
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    for node in workers:
        cluster.remove_node(node)
    cluster.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: str) -> LLM:
    """One engine in this process: what every distributed path must reproduce."""
    return LLM(tiny_llama_dir, **ENGINE_ARGS)


def _tokens(llm: LLM, prompts: list[str]) -> list[tuple[int, ...]]:
    return [tuple(llm.tokenizer.encode(p)) for p in prompts]


def _expected(llm: LLM, prompts: list[tuple[int, ...]], params: SamplingParams) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate([list(p) for p in prompts], params)]


@dataclass(frozen=True)
class App:
    engine: serve.handle.DeploymentHandle
    url: str
    model_name: str

    def replicas(self) -> list[dict]:
        """Every engine replica's ``stats``, in a fixed order (by replica id)."""
        answers = asyncio.run(EngineClient(self.engine).each_replica("stats"))
        return sorted(answers, key=lambda s: s["replica_id"])

    def engines(self) -> list[dict]:
        return [s["engine"] for s in self.replicas()]


@pytest.fixture(scope="module")
def app(cluster, tiny_llama_dir: str):
    """The whole application (ingress, three one-host engine replicas) behind Serve's proxy, as
    ``serve run`` and KubeRay run it (``meshserve serve --edge proxy``); the proxy listens on
    127.0.0.1 only."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    settings = _settings(tiny_llama_dir, num_replicas=3)
    # Returns once every replica has loaded and warmed up.
    serve.run(build_app(settings), name="meshserve", route_prefix="/")
    engine = serve.get_deployment_handle("Engine", app_name="meshserve")
    engine.info.remote().result()  # this process's router now knows the replicas
    yield App(engine, f"http://127.0.0.1:{port}", settings.model_name())
    serve.shutdown()


def _listening_beyond_loopback() -> dict[str, list[int]]:
    """Process title -> ports of this process and its descendants (the cluster's raylets, GCS,
    workers, Serve proxy) that listen on anything but loopback."""
    ours = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    loopback = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
    found: dict[str, list[int]] = {}
    for line in out.splitlines():
        host, port = line.split()[3].rsplit(":", 1)
        owner = re.search(r'\("([^"]+)",pid=(\d+)', line)
        if host.strip("[]") not in loopback and owner and int(owner[2]) in ours:
            found.setdefault(owner[1], []).append(int(port))
    return found


# --- Plain data: slice shapes and cache agreement -----------------------------------------


def _node(resources: dict, labels: dict) -> dict:
    return {"NodeID": uuid.uuid4().hex, "Alive": True, "Resources": resources, "Labels": labels}


def _tpu_node(pod_type: str, topology: str, chips: int) -> dict:
    return _node({"CPU": 8, "TPU": chips}, {"ray.io/tpu-pod-type": pod_type,
                                            "ray.io/tpu-topology": topology})


def test_the_tpu_slice_shape_is_read_from_the_labels_ray_puts_on_tpu_nodes():
    assert tpu_slice_shape([_node({"CPU": 8}, {})]) is None
    two_hosts = tpu_slice_shape([_node({"CPU": 8}, {}), _tpu_node("v4-16", "2x2x2", 4),
                                 _tpu_node("v4-16", "2x2x2", 4)])
    assert two_hosts == TpuSliceShape("2x2x2", "v4", 4) and two_hosts.num_hosts == 2
    assert tpu_slice_shape([_tpu_node("v6e-8", "2x4", 8)]).num_hosts == 1
    assert tpu_slice_shape([_tpu_node("v6e-16", "4x4", 4)]).num_hosts == 4
    with pytest.raises(ValueError, match="mixes TPU slice shapes"):
        tpu_slice_shape([_tpu_node("v4-16", "2x2x2", 4), _tpu_node("v6e-8", "2x4", 8)])
    # Without slice labels a TPU node is a one-host slice (tests/test_slice_placement.py).
    assert tpu_slice_shape([_node({"TPU": 4}, {})]) == TpuSliceShape(None, None, 4)


def test_hosts_of_a_replica_must_agree_on_the_cache_shape():
    def info(host: int, blocks: int) -> HostInfo:
        return HostInfo(f"node-{host}", host, "m", 256, 100, blocks, 16)

    check_agreement([info(0, 64), info(1, 64)])
    with pytest.raises(HostError, match="host 0 has 64 blocks .* host 1 has 63 .* num_kv_blocks"):
        check_agreement([info(0, 64), info(1, 63)])


# --- One host per replica, three hosts ------------------------------------------------------


@slow
def test_each_replica_has_its_own_node_and_nothing_leaves_loopback(cluster, app):
    states = app.replicas()
    node_ids = [s["node_ids"] for s in states]
    assert [len(ids) for ids in node_ids] == [1, 1, 1]
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len({ids[0] for ids in node_ids}) == 3 and {ids[0] for ids in node_ids} <= alive
    assert {s["placement"] for s in states} == {"cpu"}
    # GCS, raylets, workers, engine replicas, the HTTP proxy and (through deploy/loopback.py) the
    # Serve replicas' inter-deployment gRPC servers all listen on loopback only.
    assert _listening_beyond_loopback() == {}


@slow
def test_a_batch_reaches_every_replica_and_equals_one_engine(app, reference):
    prompts = _tokens(reference, PROMPTS)
    before = app.engines()
    responses = [app.engine.generate.remote(GenerateSpec(uuid.uuid4().hex, p, GREEDY))
                 for p in prompts]
    completions: list[Completion] = [r.result() for r in responses]
    assert [list(c.token_ids) for c in completions] == _expected(reference, prompts, GREEDY)
    assert all(c.finish_reason in ("length", "stop") for c in completions)
    after = app.engines()
    served = [a["prefix_cache_queried_tokens"] - b["prefix_cache_queried_tokens"]
              for a, b in zip(after, before)]
    assert all(tokens > 0 for tokens in served), served


@slow
def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica_with_cache_hits(app, reference):
    # It runs before the HTTP tests on purpose: their ingress is another caller, and the load
    # reports polled while its requests ran can make a replica look busy here for seconds after.
    shared = reference.tokenizer.encode(" ".join(f"rule {i}: be kind." for i in range(20)))
    assert len(shared) > 4 * 16 + 16  # longer than the affinity span (4 blocks)
    questions = ["Who?", "What?", "Where?", "When?"]
    before = app.engines()
    for question in questions:  # one after another: idle replicas would otherwise rotate
        prompt = tuple(shared) + tuple(reference.tokenizer.encode(question))
        app.engine.generate.remote(GenerateSpec(uuid.uuid4().hex, prompt, GREEDY)).result()
    after = app.engines()
    queried = [a["prefix_cache_queried_tokens"] - b["prefix_cache_queried_tokens"]
               for a, b in zip(after, before)]
    hits = [a["prefix_cache_hit_tokens"] - b["prefix_cache_hit_tokens"]
            for a, b in zip(after, before)]
    assert sum(q > 0 for q in queried) == 1, queried
    # Every request after the first finds the shared prefix's full blocks already cached.
    assert max(hits) >= (len(questions) - 1) * (len(shared) // 16) * 16, hits

    # Unrelated prompts, one after another, are not drawn to the shared prefix's replica: they
    # spread. (Not necessarily over all three: this process may see a call's result before its
    # router counts the call as ended, so the replica it just used can still look busy.)
    before = app.engines()
    for p in _tokens(reference, PROMPTS[:3]):
        app.engine.generate.remote(GenerateSpec(uuid.uuid4().hex, p, GREEDY)).result()
    after = app.engines()
    used = [a["prefix_cache_queried_tokens"] > b["prefix_cache_queried_tokens"]
            for a, b in zip(after, before)]
    assert sum(used) >= 2, used


@slow
def test_a_client_submits_straight_to_the_lead_of_a_replica_it_streams_from(app, reference):
    # Before the HTTP tests, as the prefix-affinity test: the ingress is another caller, and the
    # load reports polled while its requests ran can make replicas look busy here for seconds.
    prompts = _tokens(reference, PROMPTS)
    client = EngineClient(app.engine)
    through_handle: list[str] = []
    call = client._call

    def counted(method: str, *args, **kwargs):
        if method == "submit":
            through_handle.append(args[1].request_id)
        return call(method, *args, **kwargs)

    client._call = counted

    async def one_after_another() -> list[Completion]:
        return [await client.generate(GenerateSpec(uuid.uuid4().hex, p, GREEDY))
                for p in prompts]

    before = app.engines()
    completions = asyncio.run(one_after_another())
    assert [list(c.token_ids) for c in completions] == _expected(reference, prompts, GREEDY)
    after = app.engines()
    used = sum(a["prefix_cache_queried_tokens"] > b["prefix_cache_queried_tokens"]
               for a, b in zip(after, before))
    # Idle replicas take turns, as through the handle; only a replica's first sequence in this
    # process goes through the Engine deployment, the rest straight to its lead host.
    assert used >= 2, used
    assert len(through_handle) <= used, through_handle


@slow
def test_clients_of_one_process_one_after_another_each_get_every_token(app, reference):
    # A Ray program may make a client per event loop (asyncio.run each time). A client whose loop
    # has ended leaves its output stream open at the lead until its lease runs out (Ray does not
    # end a stream whose reader is gone); the next client must not read from the same channel,
    # or that stream takes its share of the tokens.
    prompts = _tokens(reference, PROMPTS[3:5])

    async def first() -> str:
        client = EngineClient(app.engine)
        await client.generate(GenerateSpec(uuid.uuid4().hex, prompts[0], GREEDY))
        (replica_id,) = client._leads  # whose lead keeps streaming to this client
        return replica_id

    used = asyncio.run(first())
    second = EngineClient(app.engine)
    router = second.book.placer
    second.book.placer = lambda spec: used
    try:
        completion = asyncio.run(asyncio.wait_for(
            second.generate(GenerateSpec(uuid.uuid4().hex, prompts[1], GREEDY)), 60))
    finally:
        second.book.placer = router
    assert list(completion.token_ids) == _expected(reference, [prompts[1]], GREEDY)[0]


@slow
def test_six_prompts_are_split_across_replicas_and_returned_in_order(app, reference):
    prompts = PROMPTS[:6]
    expected = [out.outputs[0].text for out in reference.generate(prompts, GREEDY)]
    assert len(set(expected)) == 6  # distinct answers, so the order is visible
    before = app.engines()
    response = httpx.post(f"{app.url}/v1/completions", timeout=60, json={
        "model": app.model_name, "prompt": prompts, "max_tokens": GREEDY.max_tokens,
        "temperature": 0})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    assert [c["text"] for c in choices] == expected
    after = app.engines()
    used = [a["prefix_cache_queried_tokens"] > b["prefix_cache_queried_tokens"]
            for a, b in zip(after, before)]
    assert sum(used) >= 2, used


@slow
def test_streaming_through_the_engine_handle_delivers_every_token_once_in_order(app,
                                                                              reference):
    prompt = _tokens(reference, ["Streaming, one token at a time:"])[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _expected(reference, [prompt], params)[0]
    stream = app.engine.options(stream=True).generate_stream.remote(
        GenerateSpec(uuid.uuid4().hex, prompt, params))
    deltas = [d for batch in stream for d in batch]
    assert [t for d in deltas for t in d.token_ids] == expected
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]

    # The same through HTTP: server-sent events, each a piece of the text, ending in [DONE].
    text = reference.tokenizer.decode(prompt)
    want = reference.generate([text], params)[0].outputs[0].text
    pieces, reasons = [], []
    with httpx.stream("POST", f"{app.url}/v1/completions", timeout=60, json={
            "model": app.model_name, "prompt": text, "max_tokens": params.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        events = list(sse_events(response.iter_lines()))
    assert events[-1] == DONE
    for event in events[:-1]:
        choice = event["choices"][0]
        pieces.append(choice["text"])
        reasons.append(choice["finish_reason"])
    assert "".join(pieces) == want
    assert reasons.count("length") == 1 and reasons[-1] == "length"


@slow
def test_a_sequence_sent_to_a_retiring_replica_is_placed_on_another(app, reference):
    # Last of the tests on ``app``: the replica it retires takes nothing new afterwards.
    # Serve's routers drop a replica it stops before asking its lead to retire, but a caller that
    # streams from that lead submits to it directly and may choose it in between; the window is
    # opened here by choosing the retiring replica once, as such a caller would.
    prompts = _tokens(reference, PROMPTS[:2])
    long = GenerateSpec(uuid.uuid4().hex, prompts[0],
                        SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    late = GenerateSpec(uuid.uuid4().hex, prompts[1], GREEDY)
    client = EngineClient(app.engine)

    async def scenario() -> tuple[list[int], Completion, str, dict]:
        stream = client.stream(long)
        tokens = [t for d in await anext(stream) for t in d.token_ids]
        retiring = client._replica_of[long.request_id]
        lead = client._leads[retiring]
        retired = lead.retire.remote(120.0)
        await lead.load.remote()  # runs once retire has begun: the lead now refuses new work
        router, chosen = client.book.placer, []

        def retiring_first(spec: GenerateSpec) -> str:
            chosen.append(retiring if not chosen else router(spec))
            return chosen[-1]

        client.book.placer = retiring_first
        try:
            completion = await client.generate(late)
        finally:
            client.book.placer = router
        tokens += [t for batch in [b async for b in stream] for d in batch for t in d.token_ids]
        assert chosen[0] == retiring and chosen[1] != retiring, chosen
        return tokens, completion, retiring, await retired

    tokens, completion, retiring, outcome = asyncio.run(scenario())
    assert list(completion.token_ids) == _expected(reference, [late.prompt_token_ids], GREEDY)[0]
    # The running sequence finished where it was, and the replica then left in good order.
    assert tokens == _expected(reference, [long.prompt_token_ids], long.params)[0]
    assert outcome == {"in_flight": 1, "finished": 1, "cancelled": 0}
    assert client.book.failed(retiring)


# --- Host actors used directly, as a batch job would -----------------------------------------


@slow
def test_start_host_serves_a_batch_job_and_streams(cluster, reference, tiny_llama_dir):
    host = start_host(_settings(tiny_llama_dir).engine)
    try:
        prompts = _tokens(reference, PROMPTS)
        completions = ray.get([host.generate.remote(p, GREEDY) for p in prompts], timeout=120)
        assert [list(c.token_ids) for c in completions] == _expected(reference, prompts, GREEDY)
        stream = host.generate_stream.options(num_returns="streaming").remote(prompts[0], GREEDY)
        assert [t for ref in stream for d in ray.get(ref) for t in d.token_ids] == \
            list(completions[0].token_ids)
        with pytest.raises(ValueError, match="prompt: must not be empty"):
            ray.get(host.generate.remote([], GREEDY), timeout=60)
        # A duplicate of a running id is refused and the running request goes on untouched. Both
        # travel in one call: separate calls to an async actor may run in either order, and the
        # first could also finish before the second arrives.
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        channel = "duplicates"
        deltas = host.outputs.options(num_returns="streaming").remote(channel)
        errors = ray.get(host.submit.remote(channel, [
            GenerateSpec("job-1", tuple(prompts[0]), long),
            GenerateSpec("job-1", tuple(prompts[1]), GREEDY)]), timeout=60)
        assert errors[0] is None and "'job-1' is already in use" in errors[1]
        produced: list[int] = []
        for ref in deltas:
            batch = ray.get(ref, timeout=120)
            produced += [t for d in batch for t in d.token_ids]
            if batch[-1].finish_reason is not None:
                break
        assert len(produced) == 200
    finally:
        ray.kill(host)


@slow
def test_a_host_that_reserves_cpus_computes_on_the_rest_and_generates_the_same(
        cluster, reference, tiny_llama_dir):
    allowed = sorted(os.sched_getaffinity(0))  # the cluster's nodes all run on this machine
    reserved = len(allowed) - 1
    host = start_host(_settings(tiny_llama_dir).engine, reserved_cpus=reserved)
    try:
        info = ray.get(host.info.remote(), timeout=300)
        assert info.engine_cpus == tuple(allowed[reserved:])
        threads = {tid: psutil.Process(tid).cpu_affinity()
                   for tid in (t.id for t in psutil.Process(info.pid).threads())}
        # The engine's thread (and any it started) on the CPUs left; Ray's main thread anywhere.
        assert list(info.engine_cpus) in threads.values()
        assert threads[info.pid] == allowed
        prompts = _tokens(reference, PROMPTS)
        completions = ray.get([host.generate.remote(p, GREEDY) for p in prompts], timeout=120)
        assert [list(c.token_ids) for c in completions] == _expected(reference, prompts, GREEDY)
    finally:
        ray.kill(host)


@slow
def test_a_retiring_host_finishes_its_sequences_then_ends_its_streams(cluster, reference,
                                                                      tiny_llama_dir):
    # What an engine replica has its lead do when Serve stops it (EngineReplica.__del__).
    host = start_host(_settings(tiny_llama_dir).engine)
    try:
        prompt = _tokens(reference, PROMPTS[:1])[0]
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        stream = host.outputs.options(num_returns="streaming").remote("retiring")
        assert ray.get(host.submit.remote("retiring", [GenerateSpec("running", prompt, params)]),
                       timeout=60) == [None]
        retired = host.retire.remote(120.0)
        deltas = [d for ref in stream for d in ray.get(ref, timeout=120)]  # it ends, no error
        assert [t for d in deltas for t in d.token_ids] == _expected(reference, [prompt],
                                                                     params)[0]
        assert deltas[-1].finish_reason == "length"
        assert ray.get(retired, timeout=60) == {"in_flight": 1, "finished": 1, "cancelled": 0}
        with pytest.raises(ServerDraining):
            ray.get(host.submit.remote("retiring", [GenerateSpec("late", prompt, params)]),
                    timeout=60)
        assert list(host.outputs.options(num_returns="streaming").remote("late")) == []
    finally:
        ray.kill(host)


# --- Multi-host replicas: lockstep ----------------------------------------------------------


class DivergentFollower(FollowerHost):
    """Test-only: a follower that samples a different token on its third step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0

    def run(self, number: int) -> dict[str, int]:
        tokens = super().run(number)
        self.steps += 1
        if self.steps == 3 and tokens:
            request_id = min(tokens)
            tokens = {**tokens, request_id: tokens[request_id] + 1}
        return tokens


@slow
def test_a_follower_out_of_step_fails_every_stream_of_the_replica(cluster, reference,
                                                                   tiny_llama_dir):
    settings = _settings(tiny_llama_dir, hosts_per_replica=2)
    placement = place_hosts(1, 2, settings.placement.host_num_cpus)
    group = start_replica(placement.replicas[0], settings.engine,
                          follower_class=DivergentFollower)
    try:
        # What the replica's supervisor keeps pending (EngineReplica._watch_lead).
        stopped = group.lead.stopped.remote()
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        calls = [group.lead.generate.remote(p, params) for p in _tokens(reference, PROMPTS[:2])]
        ready, _ = ray.wait([stopped], timeout=0)
        assert not ready  # pending while the engine serves
        for call in calls:
            with pytest.raises(HostError, match="host 1 fell out of step at step 3"):
                ray.get(call, timeout=120)
        assert "host 1 fell out of step at step 3" in ray.get(stopped, timeout=10)
        with pytest.raises(HostError, match="out of step"):  # and it takes no more work
            ray.get(group.lead.generate.remote((1, 2, 3), params), timeout=60)
    finally:
        group.kill()
        placement.release()


@ray.remote(num_cpus=0)
def _fail_as_replica(replica_id: str) -> None:
    raise ReplicaGone(f"engine replica {replica_id} failed: host 0 engine failed", replica_id)


@slow
def test_a_failed_replica_names_itself_across_ray_so_callers_skip_it(cluster):
    # What Engine.submit raises when its lead's engine has stopped: the caller must see a lost
    # replica (and which), not a request error, so that it retries elsewhere.
    with pytest.raises(ReplicaGone) as caught:
        ray.get(_fail_as_replica.remote("replica-7"), timeout=60)
    assert replica_lost(caught.value)
    assert caught.value.replica_id == "replica-7"
    assert "host 0 engine failed" in str(caught.value)


# --- A simulated two-host TPU slice ---------------------------------------------------------


@pytest.fixture(scope="module")
def tpu_replica(cluster, tiny_llama_dir):
    """Two nodes that Ray takes for the hosts of a v4-16 slice, and one replica placed on it."""
    envs = [{**TPU_SLICE, "TPU_WORKER_ID": str(worker)} for worker in range(2)]
    with tpu_nodes(cluster, envs):
        settings = _settings(tiny_llama_dir, hosts_per_replica=2, num_replicas=1)
        placement, (group,) = start_replicas(settings.engine, settings.placement)
        yield placement, group
        group.kill()
        placement.release()


@slow
def test_a_tpu_slice_replica_is_placed_by_rays_slice_placement_group(tpu_replica):
    placement, group = tpu_replica
    assert placement.mode == "tpu"
    # The lead answers once every host has allocated the agreed cache (ReplicaGroup.ready).
    lead = ray.get(group.lead.info.remote(), timeout=120)
    infos = [lead, *ray.get([h.info.remote() for h in group.followers], timeout=120)]
    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    lead_node, follower_node = (nodes[info.node_id] for info in infos)
    assert lead_node["NodeID"] != follower_node["NodeID"]
    assert lead_node["Resources"].get("TPU-v4-16-head") == 1
    assert "TPU-v4-16-head" not in follower_node["Resources"]
    assert [n["Labels"]["ray.io/tpu-worker-id"] for n in (lead_node, follower_node)] == ["0", "1"]
    # Each actor got the TPU runtime environment of its worker index.
    assert [info.tpu_env for info in infos] == [
        {"TPU_WORKER_ID": str(w), "TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1"} for w in (0, 1)]


@slow
def test_lockstep_generation_on_the_slice_equals_one_engine(tpu_replica, reference):
    _, group = tpu_replica
    prompts = _tokens(reference, PROMPTS)
    completions = ray.get([group.lead.generate.remote(p, GREEDY) for p in prompts], timeout=120)
    assert [list(c.token_ids) for c in completions] == _expected(reference, prompts, GREEDY)


@slow
def test_a_follower_that_dies_mid_run_fails_the_replica_loudly(tpu_replica, reference):
    _, group = tpu_replica
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    streams = [group.lead.generate_stream.options(num_returns="streaming").remote(p, params)
               for p in _tokens(reference, PROMPTS[:2])]
    ray.get(next(streams[0]), timeout=60)  # generation is under way
    ray.kill(group.followers[0])
    for stream in streams:
        with pytest.raises(HostError, match="host 1 failed at step"):
            for ref in stream:
                ray.get(ref, timeout=60)


@slow
def test_a_replica_must_span_a_whole_slice(tpu_replica):
    with pytest.raises(ValueError, match="have 2 host.* hosts_per_replica must be 2, not 1"):
        place_hosts(num_replicas=1, hosts_per_replica=1, host_num_cpus=1.0)
