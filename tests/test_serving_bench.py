"""The serving benchmark's own logic, checked without a model server: statistics, SSE parsing of
recorded streams split at awkward places, prompt determinism, reports, the CLI wiring, and a real
connection failure. The end-to-end run against meshserve's server lives with the server tests."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from meshserve.benchmark.cli import add_bench_parser
from meshserve.benchmark.client import run_benchmark
from meshserve.benchmark.prompts import load_prompts, synthetic_prompts
from meshserve.benchmark.report import (format_comparison, format_round, format_table,
                                         median_comparison, write_report)
from meshserve.benchmark.results import (BenchConfig, BenchResult, RequestResult, Round,
                                          percentiles, pooled)
from meshserve.benchmark.stream import SSEDecoder, StreamTimer


def _chunk(text: str, usage: dict | None = None) -> dict:
    choices = [] if usage else [{"index": 0, "text": text, "finish_reason": None}]
    return {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": choices,
            "usage": usage}


# A vLLM-shaped /v1/completions stream with include_usage: three text chunks (one with a
# multi-byte character), an empty-text finish chunk, the usage-only chunk, then [DONE].
EVENTS = [_chunk("Hello"), _chunk(" café ☕"), _chunk(" world"), _chunk(""),
          _chunk("", usage={"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11})]
RECORDED = b"".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n".encode() for e in EVENTS)
RECORDED += b"data: [DONE]\n\n"
EXPECTED_DATA = [json.dumps(e, ensure_ascii=False) for e in EVENTS] + ["[DONE]"]


# --- Statistics -----------------------------------------------------------------------------


def test_percentiles_match_numpy_linear_interpolation() -> None:
    values = [float(v) for v in range(1, 101)]
    stats = percentiles(values)
    assert stats == pytest.approx({"mean": 50.5, "p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert percentiles([3.0]) == {"mean": 3.0, "p50": 3.0, "p90": 3.0, "p99": 3.0}


def test_percentiles_of_nothing_are_none_not_nan() -> None:
    assert percentiles([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot_is_time_after_the_first_token_per_remaining_token() -> None:
    streamed = RequestResult(ok=True, e2e=1.0, ttft=0.1, output_tokens=10, itl=(0.1,) * 9)
    assert streamed.tpot == pytest.approx(0.1)
    # Without streaming the first token is not timed apart from the end: no TPOT, not zero.
    assert RequestResult(ok=True, e2e=1.0, ttft=1.0, output_tokens=10).tpot is None
    assert RequestResult(ok=True, e2e=1.0, ttft=0.5, output_tokens=1, itl=()).tpot is None


# --- Server-sent events ---------------------------------------------------------------------


def _decode_in_pieces(stream: bytes, cuts: list[int]) -> list[str]:
    decoder = SSEDecoder()
    bounds = [0, *sorted(cuts), len(stream)]
    return [data for a, b in zip(bounds, bounds[1:]) for data in decoder.feed(stream[a:b])]


def test_sse_decoder_is_indifferent_to_where_chunks_split() -> None:
    assert _decode_in_pieces(RECORDED, []) == EXPECTED_DATA
    # One cut at every position: inside "data:", inside the UTF-8 bytes of "é" and "☕",
    # between the two newlines that end an event.
    for cut in range(1, len(RECORDED)):
        assert _decode_in_pieces(RECORDED, [cut]) == EXPECTED_DATA, cut
    assert _decode_in_pieces(RECORDED, list(range(1, len(RECORDED)))) == EXPECTED_DATA
    rng = np.random.default_rng(0)
    for _ in range(200):
        cuts = rng.choice(np.arange(1, len(RECORDED)), size=8, replace=False).tolist()
        assert _decode_in_pieces(RECORDED, cuts) == EXPECTED_DATA


def test_sse_decoder_follows_the_spec_for_crlf_comments_and_multiline_data() -> None:
    stream = b": keep-alive\r\n\r\nevent: x\r\ndata: a\r\ndata:b\r\n\r\ndata: [DONE]\r\n\r\n"
    for cut in range(1, len(stream)):
        assert _decode_in_pieces(stream, [cut]) == ["a\nb", "[DONE]"], cut


def test_stream_timer_times_text_chunks_and_takes_tokens_from_usage() -> None:
    # Feed the recording one event per read at known times: events 0-2 carry text.
    timer = StreamTimer(start=10.0)
    events = RECORDED.split(b"\n\n")[:-1]
    for i, event in enumerate(events):
        timer.feed(event + b"\n\n", now=10.5 + 0.25 * i)
    result = timer.result(end=12.0)
    assert result.ok and result.error is None
    assert result.ttft == pytest.approx(0.5)
    assert result.itl == pytest.approx((0.25, 0.25))  # the empty finish chunk is not a token
    assert (result.output_tokens, result.prompt_tokens) == (4, 7)
    assert result.e2e == pytest.approx(2.0)
    assert result.tpot == pytest.approx((2.0 - 0.5) / 3)


def test_stream_timer_counts_text_chunks_when_the_server_sends_no_usage() -> None:
    # A server that ignores stream_options: no usage chunk, so text chunks are counted.
    without_usage = RECORDED.replace(f"data: {EXPECTED_DATA[-2]}\n\n".encode(), b"")
    assert without_usage != RECORDED
    timer = StreamTimer(start=0.0)
    timer.feed(without_usage, now=1.0)
    result = timer.result(end=1.0)
    assert result.ok and result.output_tokens == 3


def test_stream_timer_fails_on_error_events_and_truncated_streams() -> None:
    timer = StreamTimer(start=0.0)
    timer.feed(b'data: {"error": {"message": "boom", "code": 500}}\n\n', now=0.1)
    result = timer.result(end=0.2)
    assert not result.ok and "boom" in result.error

    timer = StreamTimer(start=0.0)
    timer.feed(RECORDED[: RECORDED.index(b"data: [DONE]")], now=0.1)
    result = timer.result(end=0.2)
    assert not result.ok and "[DONE]" in result.error


# --- Prompts and configuration --------------------------------------------------------------


def test_synthetic_prompts_are_deterministic_varied_and_distinct() -> None:
    prompts = synthetic_prompts(50, seed=0, words=(16, 256))
    assert prompts == synthetic_prompts(50, seed=0, words=(16, 256))
    assert prompts != synthetic_prompts(50, seed=1, words=(16, 256))
    lengths = [len(p.split()) for p in prompts]
    assert all(16 <= n <= 256 for n in lengths)
    assert max(lengths) - min(lengths) > 100  # varied, not one length
    assert len({p[:40] for p in prompts}) == 50  # no shared opening for a prefix cache to reuse
    assert all(p.isascii() and p.endswith(".") for p in prompts)


def test_dataset_prompts_are_used_in_order_and_repeated(tmp_path: Path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "one"}\n\n{"prompt": "two", "extra": 1}\n', encoding="utf-8")
    config = BenchConfig(url="http://h", model="m", num_prompts=5, dataset=str(dataset))
    assert load_prompts(config) == ["one", "two", "one", "two", "one"]
    dataset.write_text('{"text": "one"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="string 'prompt'"):
        load_prompts(config)


@pytest.mark.parametrize("changes, message", [
    ({"url": "localhost:8000"}, "http://"), ({"model": ""}, "model"),
    ({"concurrency": 0}, "concurrency"), ({"num_prompts": 0}, "num_prompts"),
    ({"max_tokens": 0}, "max_tokens"), ({"timeout": 0}, "timeout"),
    ({"prompt_words": (10, 5)}, "prompt_words"),
])
def test_config_rejects_bad_values(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BenchConfig(**{"url": "http://h:1", "model": "m", **changes})


def test_completions_url_accepts_a_root_or_a_v1_base() -> None:
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert BenchConfig(url=url, model="m").completions_url == "http://h:8000/v1/completions"


# --- Reports --------------------------------------------------------------------------------


def _result(stream: bool) -> BenchResult:
    config = BenchConfig(url="http://h:8000", model="m", num_prompts=4, stream=stream,
                         api_key="secret")
    ok = [RequestResult(ok=True, e2e=1.0 + i, ttft=0.1 * (i + 1) if stream else 1.0 + i,
                        output_tokens=11, itl=(0.09,) * 10 if stream else ())
          for i in range(3)]
    failed = RequestResult(ok=False, e2e=0.5, error="HTTP 503: overloaded")
    return BenchResult(config=config, duration=4.0, requests=(*ok, failed))


def test_summary_counts_throughput_and_milliseconds() -> None:
    summary = _result(stream=True).summary()
    assert (summary["completed"], summary["failed"]) == (3, 1)
    assert summary["errors"] == [{"message": "HTTP 503: overloaded", "count": 1}]
    assert summary["request_throughput"] == pytest.approx(0.75)
    assert summary["output_throughput"] == pytest.approx(33 / 4)
    assert summary["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert summary["tpot_ms"]["p50"] == pytest.approx((2.0 - 0.2) / 10 * 1000)
    assert summary["e2e_ms"]["mean"] == pytest.approx(2000.0)


@pytest.mark.parametrize("stream", [True, False])
def test_report_writes_json_and_png_beside_it(tmp_path: Path, stream: bool) -> None:
    result = _result(stream)
    json_path, png_path = write_report(result, tmp_path / "out" / "serve.json")
    assert png_path == tmp_path / "out" / "serve.png"
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png_path.stat().st_size > 10_000
    report = json.loads(json_path.read_text(encoding="utf-8"))
    assert report["config"]["api_key"] == "<set>"  # the key itself stays off disk
    assert report["config"]["stream"] is stream
    assert report["results"] == json.loads(json.dumps(result.summary()))
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["platform"]
    assert len(report["requests"]) == 4
    table = format_table(result)
    assert "Completed / failed          3 / 1" in table and "HTTP 503" in table
    tpot_row = next(line for line in table.splitlines() if line.startswith("TPOT"))
    assert ("n/a" in tpot_row) is not stream


def test_report_keeps_request_times_to_the_microsecond(tmp_path: Path) -> None:
    timed = RequestResult(ok=True, e2e=1.23456789, ttft=0.12345649, output_tokens=3,
                          itl=(0.5555557, 0.5555552))
    result = BenchResult(config=BenchConfig(url="http://h:8000", model="m", num_prompts=1,
                                            stream=True), duration=2.0, requests=(timed,))
    json_path, _ = write_report(result, tmp_path / "us.json")
    [request] = json.loads(json_path.read_text(encoding="utf-8"))["requests"]
    assert (request["e2e"], request["ttft"], request["itl"]) == (1.234568, 0.123456,
                                                                 [0.555556, 0.555555])
    assert request["tpot"] == round(timed.tpot, 6) and request["output_tokens"] == 3


# --- CLI and a real connection failure ------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_registers_bench_serve_with_the_documented_defaults() -> None:
    args = _parser().parse_args(["bench", "serve", "--url", "http://h:8000", "--model", "m",
                                 "--num-prompts", "3", "--concurrency", "2"])
    assert callable(args.func)
    assert (args.stream, args.max_tokens, args.seed, args.timeout, args.output) == (
        False, 64, 0, 300.0, "bench/results/serve.json")
    assert (args.compare, args.rounds, args.pause) == (None, 1, 5.0)


def test_cli_reports_bad_flags_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["bench", "serve", "--url", "h:8000", "--model", "m"])
    assert args.func(args) == 2
    assert "http://" in capsys.readouterr().err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_fails_every_request_and_exits_1(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    result = asyncio.run(run_benchmark(BenchConfig(url=url, model="m", num_prompts=5,
                                                   concurrency=2, stream=True, timeout=30)))
    assert len(result.requests) == 5 and not result.completed
    assert all(r.error.startswith("ClientConnectorError") for r in result.requests)

    output = tmp_path / "serve.json"
    args = _parser().parse_args(["bench", "serve", "--url", url, "--model", "m",
                                 "--num-prompts", "3", "--output", str(output)])
    assert args.func(args) == 1
    assert json.loads(output.read_text(encoding="utf-8"))["results"]["failed"] == 3


# --- Two servers back to back (--compare) ---------------------------------------------------


def test_a_comparison_report_holds_both_runs_their_ratios_and_one_chart(tmp_path: Path) -> None:
    ours = _result(stream=True)
    slower = [RequestResult(ok=True, e2e=2.0 + i, ttft=0.4, output_tokens=11, itl=(0.18,) * 10)
              for i in range(3)]
    peer = BenchResult(config=BenchConfig(url="http://peer:9000", model="p", num_prompts=3,
                                          stream=True), duration=8.0, requests=tuple(slower))
    json_path, png_path = write_report(ours, tmp_path / "cmp.json", peer)
    report = json.loads(json_path.read_text(encoding="utf-8"))
    assert [run["config"]["url"] for run in report["runs"]] == ["http://h:8000", "http://peer:9000"]
    assert report["runs"][0]["config"]["api_key"] == "<set>"
    assert report["runs"][1]["results"] == json.loads(json.dumps(peer.summary()))
    assert report["comparison"]["output_throughput"] == pytest.approx((33 / 4) / (33 / 8), abs=1e-3)
    assert report["comparison"]["ttft_p50"] == pytest.approx(200 / 400, abs=1e-3)
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "2.00x" in format_comparison(ours, peer)


def test_compare_runs_both_servers_and_names_the_peers_model(tmp_path: Path) -> None:
    url, peer = (f"http://127.0.0.1:{_closed_port()}" for _ in range(2))
    args = _parser().parse_args(["bench", "serve", "--url", url, "--model", "m", "--compare", peer])
    assert args.func(args) == 2  # nothing answers /v1/models there: the peer cannot be named
    output = tmp_path / "both.json"
    args = _parser().parse_args(["bench", "serve", "--url", url, "--model", "m", "--compare", peer,
                                 "--compare-model", "p", "--num-prompts", "2", "--pause", "0",
                                 "--output", str(output)])
    assert args.func(args) == 1
    runs = json.loads(output.read_text(encoding="utf-8"))["runs"]
    assert [(r["config"]["model"], r["results"]["failed"]) for r in runs] == [("m", 2), ("p", 2)]


# --- Several rounds (--rounds) --------------------------------------------------------------


def _run(url: str, seed: int, duration: float, ttft: float) -> BenchResult:
    """Two streamed requests of 11 tokens each, both with first token at ``ttft``."""
    requests = tuple(RequestResult(ok=True, e2e=1.0, ttft=ttft, output_tokens=11,
                                   itl=(0.05,) * 10) for _ in range(2))
    return BenchResult(config=BenchConfig(url=url, model="m", num_prompts=2, stream=True,
                                          seed=seed), duration=duration, requests=requests)


def test_pooled_runs_keep_every_request_over_their_summed_time() -> None:
    runs = [_run("http://h:8000", 0, 2.0, 0.1), _run("http://h:8000", 1, 6.0, 0.3)]
    total = pooled(runs)
    assert len(total.requests) == 4 and total.duration == 8.0 and total.config.seed == 0
    assert total.summary()["output_throughput"] == pytest.approx(44 / 8)
    assert total.summary()["ttft_ms"]["p50"] == pytest.approx(200.0)
    with pytest.raises(ValueError, match="at least one run"):
        pooled([])


def test_a_report_of_rounds_gives_each_round_and_the_medians_of_their_ratios(
        tmp_path: Path) -> None:
    # Throughput ratios 2.0, 0.5, 1.25 (median 1.25); TTFT p50 ratios 0.5, 2.0, 1.0 (median 1.0).
    shapes = [((2.0, 0.1), (4.0, 0.2)), ((4.0, 0.4), (2.0, 0.2)), ((4.0, 0.3), (5.0, 0.3))]
    rounds = [Round(_run("http://h:8000", seed, ours[0], ours[1]),
                    _run("http://peer:9000", seed, theirs[0], theirs[1]), peer_first=seed % 2 == 1)
              for seed, (ours, theirs) in enumerate(shapes)]
    medians = median_comparison(rounds)
    assert medians["output_throughput"] == pytest.approx(1.25)
    assert medians["ttft_p50"] == pytest.approx(1.0)
    ours, peer = pooled([r.ours for r in rounds]), pooled([r.peer for r in rounds])
    json_path, png_path = write_report(ours, tmp_path / "rounds.json", peer, rounds)
    report = json.loads(json_path.read_text(encoding="utf-8"))
    assert report["comparison"] == medians
    assert [len(run["requests"]) for run in report["runs"]] == [6, 6]
    assert [(r["seed"], r["first"]) for r in report["rounds"]] == [
        (0, "http://h:8000"), (1, "http://peer:9000"), (2, "http://h:8000")]
    assert [r["comparison"]["output_throughput"] for r in report["rounds"]] == [2.0, 0.5, 1.25]
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "medians of 3 rounds: output throughput 1.25x" in format_comparison(ours, peer, rounds)
    assert format_round(1, 3, rounds[1]).startswith(
        "round 2/3 (seed 1, http://peer:9000 first): 5.5 against 11.0 tok/s; "
        "output throughput 0.50x")
    with pytest.raises(ValueError, match="with a peer"):
        median_comparison([Round(rounds[0].ours)])


def test_rounds_alternate_the_first_server_on_fresh_prompts(tmp_path: Path) -> None:
    url, peer = (f"http://127.0.0.1:{_closed_port()}" for _ in range(2))
    output = tmp_path / "rounds.json"
    args = _parser().parse_args(["bench", "serve", "--url", url, "--model", "m", "--compare", peer,
                                 "--compare-model", "p", "--num-prompts", "2", "--rounds", "3",
                                 "--seed", "5", "--pause", "0.4", "--output", str(output)])
    started = time.monotonic()
    assert args.func(args) == 1  # nothing listens: every request of every round fails
    assert time.monotonic() - started >= 5 * 0.4  # a pause before each of 6 runs but the first
    report = json.loads(output.read_text(encoding="utf-8"))
    assert [(r["seed"], r["first"]) for r in report["rounds"]] == [(5, url), (6, peer), (7, url)]
    assert [r["results"]["failed"] for r in report["runs"]] == [6, 6]
    assert report["comparison"] == {"output_throughput": None, "ttft_p50": None, "tpot_p50": None}
    for bad in (["--rounds", "0"], ["--pause", "-1"]):
        args = _parser().parse_args(["bench", "serve", "--url", url, "--model", "m", *bad])
        assert args.func(args) == 2
