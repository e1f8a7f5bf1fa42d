"""KubeRay manifests: schema-valid against KubeRay v1.7.0's CRD, consistent with the TPU topology,
and identical to what the renderer produces. No cluster, no Ray: pure data checks."""

from __future__ import annotations

import argparse
import copy
import importlib
import io
import re
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshserve.kuberay import cli
from meshserve.kuberay.deployment import Deployment
from meshserve.kuberay.examples import EXAMPLES, write_examples
from meshserve.kuberay.manifest import app_args, command_line, node_pool_commands, render, to_yaml
from meshserve.kuberay.tpu import GENERATIONS, resolve_slice

REPO = Path(__file__).resolve().parents[1]
K8S_DIR = REPO / "k8s"
CRD_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "kuberay-crds"
RAYSERVICE_CRD = CRD_DIR / "ray.io_rayservices.yaml"

ALL_SLICES = [(g.name, t) for g in GENERATIONS.values() for t in g.topologies]


# --- The strict schema ----------------------------------------------------------------------


def strict(schema: Any) -> Any:
    """A copy of an OpenAPI schema in which every object that lists ``properties`` rejects
    properties it does not list, unless the schema already says what extra keys may hold or
    keeps unknown fields. The CRD itself allows unknown fields, so a typo would pass unseen."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if ("properties" in schema and schema.get("type") == "object"
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validator() -> Any:
    if not RAYSERVICE_CRD.exists():
        pytest.skip(f"KubeRay CRDs not found at {CRD_DIR} (they live in ../shared/kuberay-crds "
                    "beside the project checkout); schema validation needs them")
    jsonschema = pytest.importorskip("jsonschema")
    crd = yaml.safe_load(RAYSERVICE_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def schema_errors(validator: Any, manifest: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(manifest)]


def committed() -> dict[str, dict[str, Any]]:
    return {name: yaml.safe_load((K8S_DIR / name).read_text()) for name in EXAMPLES}


def rendered_everywhere() -> list[dict[str, Any]]:
    return [render(Deployment(a, t, "/models/m")) for a, t in ALL_SLICES]


# --- Schema ---------------------------------------------------------------------------------


@pytest.mark.parametrize("filename", sorted(EXAMPLES))
def test_committed_manifest_is_schema_valid(validator: Any, filename: str) -> None:
    manifest = yaml.safe_load((K8S_DIR / filename).read_text())
    assert schema_errors(validator, manifest) == []


def test_rendered_manifests_are_schema_valid_for_every_slice(validator: Any) -> None:
    for manifest in rendered_everywhere():
        assert schema_errors(validator, manifest) == [], manifest["metadata"]["name"]
    with_options = render(Deployment("v6e", "4x4", "/models/m", replicas=3, name="custom",
                                     api_key_secret="meshserve-key", served_model_name="m2"))
    assert schema_errors(validator, with_options) == []


@pytest.mark.parametrize("path, typo", [
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0), "numOfHost"),
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "template", "spec"), "nodeSelecter"),
    (("spec", "rayClusterConfig", "headGroupSpec"), "rayStartParam"),
    (("spec",), "upgradeStrategyy"),
])
def test_misspelt_field_is_rejected(validator: Any, path: tuple, typo: str) -> None:
    manifest = copy.deepcopy(render(EXAMPLES["v6e-4x4-multi-host.yaml"]))
    node = manifest
    for key in path:
        node = node[key]
    node[typo] = 4
    assert any(typo in error for error in schema_errors(validator, manifest))


def test_wrong_type_is_rejected(validator: Any) -> None:
    manifest = copy.deepcopy(render(EXAMPLES["v5e-2x4-single-host.yaml"]))
    worker = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    worker["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = "lots"
    assert schema_errors(validator, manifest)


# --- What KubeRay and the TPU webhook check beyond the schema --------------------------------


def all_manifests() -> list[dict[str, Any]]:
    return list(committed().values()) + rendered_everywhere()


@pytest.mark.parametrize("manifest", all_manifests(), ids=lambda m: m["metadata"]["name"])
def test_manifest_passes_kuberay_rules(manifest: dict[str, Any]) -> None:
    name = manifest["metadata"]["name"]
    assert len(name) <= 47 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)
    spec = manifest["spec"]
    assert spec["upgradeStrategy"]["type"] in ("None", "NewCluster",
                                               "NewClusterWithIncrementalUpgrade")
    cluster = spec["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["template"]["spec"]["containers"][0]["name"] == "ray-head"
    # The head is CPU-only and advertises no CPUs to Ray, so no model work lands there.
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert "google.com/tpu" not in str(head)
    head_container = head["template"]["spec"]["containers"][0]
    assert "livenessProbe" not in head_container and "readinessProbe" not in head_container
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert "resources" not in group  # conflicts with rayStartParams resources in KubeRay
        container = group["template"]["spec"]["containers"][0]
        # KubeRay injects its warm-up-tolerant liveness probe only where none is given.
        assert "livenessProbe" not in container


# --- A slice recreated whole; a stalled request path leaves the Service ---------------------


def worker_pod(manifest: dict[str, Any]) -> dict[str, Any]:
    (group,) = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return group["template"]


@pytest.mark.parametrize("accelerator, topology", ALL_SLICES)
def test_multi_host_slices_fail_whole_pods_and_leave_the_slice_labels_to_kuberay(
        accelerator: str, topology: str) -> None:
    d = Deployment(accelerator, topology, "/models/m")
    template = worker_pod(render(d))
    if d.tpu_slice.hosts > 1:
        # KubeRay deletes (and, with the gate, recreates the slice of) failed pods only; under
        # restartPolicy Always a host's Ray container would come back alone in its old pod.
        assert template["spec"]["restartPolicy"] == "Never"
    else:
        assert "restartPolicy" not in template["spec"]  # a lone host restarts in place
    # The replica name and host index are KubeRay's to set; pods without them are not grouped.
    assert not any(key.startswith("ray.io/") for key in template.get("metadata", {})
                   .get("labels", {}))
    args = yaml.safe_load(render(d)["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert "num_kv_blocks" not in args  # the hosts agree on a cache size by themselves


@pytest.mark.parametrize("filename", sorted(EXAMPLES))
def test_multi_host_manifest_names_the_gate_and_the_kuberay_version(filename: str) -> None:
    text = (K8S_DIR / filename).read_text()
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    multi_host = EXAMPLES[filename].tpu_slice.hosts > 1
    assert ("RayMultiHostIndexing" in header) == multi_host
    assert ("KubeRay >= 1.6.0" in header) == multi_host
    assert (committed()[filename]["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]
            ["spec"].get("restartPolicy") == "Never") == multi_host


@pytest.mark.parametrize("manifest", all_manifests(), ids=lambda m: m["metadata"]["name"])
def test_worker_readiness_runs_a_completion_through_the_proxy(manifest: dict[str, Any]) -> None:
    container = worker_pod(manifest)["spec"]["containers"][0]
    probe = container["readinessProbe"]
    command = probe["exec"]["command"]
    assert command[:3] == ["python", "-m", "meshserve.kuberay.probe"]
    flags = dict(zip(command[3::2], command[4::2]))
    args = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert flags["--model"] == args["served_model_name"]
    assert int(flags["--port"]) == container["ports"][0]["containerPort"] == 8000
    # The kubelet must not cut the probe off before its own deadline reports what failed.
    assert probe["timeoutSeconds"] > float(flags["--deadline"])
    assert probe["periodSeconds"] >= float(flags["--deadline"])  # runs never overlap


# --- Topology -------------------------------------------------------------------------------


def check_topology(manifest: dict[str, Any], accelerator: str, topology: str,
                   replicas: int) -> None:
    tpu = resolve_slice(accelerator, topology)
    (group,) = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    pod = group["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    chips_in_topology = 1
    for dim in topology.split("x"):
        chips_in_topology *= int(dim)
    chips_per_pod = int(resources["limits"]["google.com/tpu"])
    assert resources["requests"]["google.com/tpu"] == resources["limits"]["google.com/tpu"]
    assert chips_per_pod == tpu.machine.chips
    # The TPU webhook's rule: numOfHosts == max(chips / chips per host, 1).
    assert group["numOfHosts"] == max(chips_in_topology // chips_per_pod, 1) == tpu.hosts
    assert group["numOfHosts"] * chips_per_pod == chips_in_topology
    assert group["replicas"] == replicas
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": GENERATIONS[accelerator].gke_accelerator,
        "cloud.google.com/gke-tpu-topology": topology,
    }
    args = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["tensor_parallel_size"] == chips_in_topology
    assert args["hosts_per_replica"] == group["numOfHosts"]
    assert args["num_replicas"] == replicas


@pytest.mark.parametrize("accelerator, topology", ALL_SLICES)
def test_render_agrees_with_topology(accelerator: str, topology: str) -> None:
    for replicas in (1, 2):
        manifest = render(Deployment(accelerator, topology, "/models/m", replicas=replicas))
        check_topology(manifest, accelerator, topology, replicas)


@pytest.mark.parametrize("filename", sorted(EXAMPLES))
def test_committed_manifest_agrees_with_topology(filename: str) -> None:
    d = EXAMPLES[filename]
    check_topology(committed()[filename], d.accelerator, d.topology, d.replicas)


def test_examples_cover_the_three_shapes() -> None:
    shapes = {name: (d.accelerator, d.topology, d.tpu_slice.hosts, d.replicas)
              for name, d in EXAMPLES.items()}
    assert shapes["v5e-2x4-single-host.yaml"] == ("v5e", "2x4", 1, 1)
    assert shapes["v6e-4x4-multi-host.yaml"] == ("v6e", "4x4", 4, 1)
    assert shapes["v6e-2x4-data-parallel.yaml"] == ("v6e", "2x4", 1, 2)


@pytest.mark.parametrize("accelerator, topology", [
    ("v5e", "3x3"), ("v5e", "4x2"), ("v6e", "2x2x1"), ("v5p", "4x4"), ("v4", "2x4"),
    ("v5e", "32x32"), ("v3", "2x2"), ("v6e", "four"),
])
def test_impossible_combination_names_the_valid_ones(accelerator: str, topology: str) -> None:
    with pytest.raises(ValueError) as error:
        Deployment(accelerator, topology, "/models/m")
    message = str(error.value)
    if accelerator in GENERATIONS:
        assert topology in message
        for valid in GENERATIONS[accelerator].topologies:
            assert valid in message
    else:
        assert all(name in message for name in GENERATIONS)


@pytest.mark.parametrize("changes, field", [
    ({"model": "models/m"}, "model"), ({"replicas": 0}, "replicas"),
    ({"name": "Meshserve"}, "name"), ({"name": "x" * 48}, "name"),
    ({"max_model_len": 0}, "max_model_len"),
])
def test_bad_deployment_fields_are_named(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Deployment(**{"accelerator": "v5e", "topology": "2x4", "model": "/models/m", **changes})


def test_table_is_self_consistent() -> None:
    for generation in GENERATIONS.values():
        for topology in generation.topologies:
            tpu = resolve_slice(generation.name, topology)
            assert tpu.chips % tpu.machine.chips == 0
            assert (tpu.hosts == 1) == (topology in dict(generation.single_host))
        assert generation.multi_host_machine.chips == 4


def test_multi_host_replicas_get_one_node_pool_each() -> None:
    commands = node_pool_commands(Deployment("v6e", "4x4", "/models/m", replicas=2))
    assert len(commands) == 2
    assert all("--tpu-topology=4x4 --num-nodes=4" in c for c in commands)
    (single,) = node_pool_commands(Deployment("v6e", "2x4", "/models/m", replicas=2))
    assert "--machine-type=ct6e-standard-8t" in single and "--num-nodes=2" in single
    assert "--tpu-topology" not in single


# --- serveConfigV2 --------------------------------------------------------------------------


@pytest.mark.parametrize("filename", sorted(EXAMPLES))
def test_serve_config_parses_with_import_path_and_args(filename: str) -> None:
    config = yaml.safe_load(committed()[filename]["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    assert app["import_path"] == "meshserve.deploy.app:build_app"
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    d = EXAMPLES[filename]
    assert app["args"] == app_args(d)
    assert app["args"]["model"] == d.model and app["args"]["device"] == "xla"
    assert set(app["args"]) >= {"model", "served_model_name", "device", "dtype",
                                "tensor_parallel_size", "hosts_per_replica", "num_replicas",
                                "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                "compile_cache_dir"}


def test_api_key_secret_reaches_args_and_every_pod() -> None:
    manifest = render(Deployment("v5e", "2x4", "/models/m", api_key_secret="meshserve-key"))
    args = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["api_key_env"] == "MESHSERVE_API_KEY"
    cluster = manifest["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        (env,) = group["template"]["spec"]["containers"][0]["env"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "meshserve-key", "key": "api-key"}
    assert "api_key_env" not in app_args(Deployment("v5e", "2x4", "/models/m"))


def test_import_path_builds_the_application_without_starting_ray() -> None:
    ray = pytest.importorskip("ray")
    from ray import serve
    # What Serve does with an import path and its args (serve run, and the controller with a
    # serveConfigV2): it also checks the builder's signature.
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    config = yaml.safe_load(render(EXAMPLES["v6e-4x4-multi-host.yaml"])["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    module_name, attribute = app["import_path"].split(":")
    builder = getattr(importlib.import_module(module_name), attribute)
    application = call_user_app_builder_with_args_if_necessary(builder, app["args"])
    assert isinstance(application, serve.Application)
    assert not ray.is_initialized()


# --- The committed files are the renderer's output ------------------------------------------


@pytest.mark.parametrize("filename", sorted(EXAMPLES))
def test_committed_manifest_equals_render(filename: str) -> None:
    assert (K8S_DIR / filename).read_text() == to_yaml(EXAMPLES[filename]), (
        "k8s/ is out of date: run `meshserve k8s write-examples k8s`")


def test_no_stray_manifests() -> None:
    assert {p.name for p in K8S_DIR.glob("*.yaml")} == set(EXAMPLES)


def test_write_examples_reproduces_committed_files(tmp_path: Path) -> None:
    for path in write_examples(tmp_path):
        assert path.read_text() == (K8S_DIR / path.name).read_text()


def test_write_examples_command_reproduces_committed_files(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="meshserve")
    cli.add_k8s_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["k8s", "write-examples", str(tmp_path)])
    with redirect_stdout(io.StringIO()):
        assert args.func(args) == 0
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {
        name: (K8S_DIR / name).read_text() for name in EXAMPLES}


def test_header_commands_reproduce_the_manifest() -> None:
    parser = argparse.ArgumentParser(prog="meshserve")
    cli.add_k8s_parser(parser.add_subparsers(dest="command"))
    for filename, d in EXAMPLES.items():
        text = (K8S_DIR / filename).read_text()
        command = text.splitlines()[0].removeprefix("# Rendered by: ")
        args = parser.parse_args(command.split()[1:])
        out = io.StringIO()
        with redirect_stdout(out):
            assert args.func(args) == 0
        assert out.getvalue() == text


def test_cli_reports_impossible_combination(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="meshserve")
    cli.add_k8s_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["k8s", "render", "--accelerator", "v5e", "--topology", "3x3",
                              "--model", "/models/m"])
    assert args.func(args) == 2
    assert "valid topologies: 1x1, 2x2, 2x4, 4x4" in capsys.readouterr().err


def test_cli_writes_output_file(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="meshserve")
    cli.add_k8s_parser(parser.add_subparsers(dest="command"))
    target = tmp_path / "svc.yaml"
    args = parser.parse_args(["k8s", "render", "--accelerator", "v6e", "--topology", "4x4",
                              "--model", "/models/m", "--replicas", "2", "-o", str(target)])
    assert args.func(args) == 0
    manifest = yaml.safe_load(target.read_text())
    assert manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] == 2


# --- The guide matches the manifests --------------------------------------------------------


def test_readme_matches_manifests() -> None:
    readme = (K8S_DIR / "README.md").read_text()
    for filename, d in EXAMPLES.items():
        assert filename in readme
        # Each example's render command, with the user's image and bucket added.
        assert f'{command_line(d)} --image "$IMAGE" --bucket "$BUCKET"' in readme
        for command in node_pool_commands(d):
            assert command.replace(" --", " \\\n    --") in readme, command
        assert f"svc/{d.service_name}-serve-svc" in readme
        assert f'"model": "{d.model_name}"' in readme
    for generation in GENERATIONS.values():
        row = next(line for line in readme.splitlines()
                   if line.startswith(f"| {generation.name} |"))
        assert all(f"`{t}`" in row for t in generation.topologies), row
    assert "--version 1.7.0" in readme
    assert "docker build --platform linux/amd64 -f k8s/Dockerfile" in readme
