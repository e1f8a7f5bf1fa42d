"""meshserve from a Ray program: host actors for a batch job, then the Engine deployment's handle.

Runs on the bundled SmolLM2-135M-Instruct, on a local Ray bound to 127.0.0.1:

    .venv/bin/python examples/ray_programmatic.py [--model PATH] [--max-tokens N] [--port P]

Host actors and engine replicas speak token ids; the tokenizer (and the chat template, if you want
one) stays in your program, as it does in meshserve's HTTP ingress.
"""

from __future__ import annotations

import os

# Keep every Ray socket on loopback; must be set before ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

import ray  # noqa: E402
from ray import serve  # noqa: E402

from meshserve import SamplingParams  # noqa: E402
from meshserve.actors import GenerateSpec, start_host  # noqa: E402
from meshserve.config import EngineConfig  # noqa: E402
from meshserve.deploy.app import build_app  # noqa: E402
from meshserve.deploy.client import EngineClient  # noqa: E402
from meshserve.runner.loader import load_tokenizer  # noqa: E402

PROMPTS = ["The capital of France is", "Water boils at a temperature of",
           "The largest planet in the solar system is", "A good name for a cat is"]


def batch_job(model: str | None, tokenizer, params: SamplingParams) -> None:
    """One HostActor, many prompts: concurrent calls share the engine's continuous batch."""
    host = start_host(EngineConfig.from_flat({"model": model, "num_kv_blocks": 512}))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    started = time.perf_counter()
    completions = ray.get([host.generate.remote(p, params) for p in prompts])
    print(f"batch job: {len(prompts)} prompts in {time.perf_counter() - started:.1f}s "
          "(model loading included)")
    for prompt, completion in zip(PROMPTS, completions):
        text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        print(f"  {prompt!r} -> {text!r} [{completion.finish_reason}]")

    # Streaming from the actor: each item is a list of TokenDelta from one or more engine steps.
    print("host stream: ", end="", flush=True)
    stream = host.generate_stream.options(num_returns="streaming").remote(prompts[0], params)
    for ref in stream:
        for delta in ray.get(ref):
            print(tokenizer.decode(delta.token_ids), end="", flush=True)
    print()
    ray.kill(host)  # frees its CPU for the Serve application below


def through_serve(model: str | None, tokenizer, params: SamplingParams, port: int) -> None:
    """The whole Serve application; a Ray program calls its Engine deployment through a handle,
    which picks a replica for each call itself (as the HTTP ingress's does)."""
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    # Returns once every engine replica has loaded and warmed up.
    serve.run(build_app({"model": model, "num_kv_blocks": 512}), name="meshserve",
              route_prefix="/")
    engine = serve.get_deployment_handle("Engine", app_name="meshserve")

    spec = GenerateSpec(uuid.uuid4().hex, tuple(tokenizer.encode(PROMPTS[0])), params)
    completion = engine.generate.remote(spec).result()
    print("engine generate:", repr(tokenizer.decode(completion.token_ids,
                                                    skip_special_tokens=True)))

    print("engine stream: ", end="", flush=True)
    spec = GenerateSpec(uuid.uuid4().hex, spec.prompt_token_ids, params)
    for batch in engine.options(stream=True).generate_stream.remote(spec):
        for delta in batch:
            print(tokenizer.decode(delta.token_ids), end="", flush=True)
    print()

    # Many sequences at once, their tokens over one stream per engine replica.
    async def many() -> None:
        client = EngineClient(engine)
        specs = [GenerateSpec(uuid.uuid4().hex, tuple(tokenizer.encode(p)), params)
                 for p in PROMPTS]
        for prompt, done in zip(PROMPTS, await asyncio.gather(*map(client.generate, specs))):
            print(f"  {prompt!r} -> {tokenizer.decode(done.token_ids, skip_special_tokens=True)!r}")
        print("engine replicas:", [(s["replica_id"], s["engine"]["num_free_blocks"])
                                   for s in await client.each_replica("stats")])

    asyncio.run(many())
    serve.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="folder or .gguf (default: bundled)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--port", type=int, default=8000, help="Serve's HTTP port (127.0.0.1)")
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    tokenizer = load_tokenizer(args.model)
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False)
    try:
        batch_job(args.model, tokenizer, params)
        through_serve(args.model, tokenizer, params, args.port)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
