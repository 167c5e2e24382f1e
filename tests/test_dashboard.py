"""The Grafana dashboard in docker/ against a real worker: every PromQL expression in it names
only metrics and labels that `kiln worker --metrics-port` exports, no exported label carries a job
id or a prompt, and compose provisions Prometheus (scraping every worker) and Grafana (reading
that dashboard) consistently. Docker is not run here: compose and provisioning are read as YAML."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from api_client import KilnClient
from tests.conftest import ROOT
from tests.promql import Query, parse, parse_variable
from tests.workers import WorkerProcess, free_port, wait_until

DOCKER = ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "kiln.json"
# Prometheus adds these to every series it scrapes (job from prometheus.yml, instance: the target).
TARGET_LABELS = {"job", "instance"}
MODEL = "tiny-sd15"


def dashboard_queries() -> list[tuple[str, Query]]:
    """(where, parsed) for every panel target and template variable of the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    found = [
        (f"panel {panel['title']!r}: {target['expr']}", parse(target["expr"]))
        for panel in board["panels"]
        for target in panel["targets"]
    ]
    found += [
        (f"variable {var['name']}", parse_variable(var["query"]["query"]))
        for var in board["templating"]["list"]
    ]
    return found


def scrape(port: int) -> dict[str, set[str]]:
    """Sample name -> label names, as the worker's /metrics has them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    exported: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    return exported


def sample_values(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_every_dashboard_expression_names_what_a_live_worker_exports(
    redis_conn: Redis, kiln_env: dict[str, str], tmp_path: Path
) -> None:
    port = free_port()
    # Two drilled OOMs at full make the OOM and descent series real, not only declared.
    env = {**kiln_env, "KILN_FAULTS": "oom@denoise:full*2"}
    worker = WorkerProcess(env, tmp_path / "w.log", "--models", MODEL, "--metrics-port", str(port))
    prompt = "a lighthouse at dusk, unique-prompt-7731"
    try:
        worker.wait_ready(redis_conn)
        client = KilnClient(connection=redis_conn, manifests_dir=ROOT / "manifests")
        # Two jobs at the default size: the second is warm, so a timing fit (and an ETA) exists.
        jobs = [client.submit({"model": MODEL, "prompt": prompt, "steps": 2}) for _ in range(2)]
        for job in jobs:
            job.wait(timeout=120)
        exported = wait_until(
            lambda: (found := scrape(port)) and "kiln_queue_eta_seconds" in found and found,
            30,
            "the next-job ETA on /metrics",
            poll=0.5,
        )
        values = sample_values(port)
    finally:
        worker.stop()

    problems = []
    for where, query in dashboard_queries():
        read: set[str] = set(TARGET_LABELS)
        for metric, labels in query.metrics.items():
            if metric not in exported:
                problems.append(f"{where}: {metric} is not exported")
                continue
            read |= exported[metric]
            unknown = labels - exported[metric] - TARGET_LABELS
            if unknown:
                problems.append(f"{where}: {metric} has no label {sorted(unknown)}")
        if query.grouping - read:
            problems.append(f"{where}: groups by {sorted(query.grouping - read)}, not exported")
    assert not problems, "\n".join(problems)

    kiln_series = {k: v for k, v in values.items() if k[0].startswith("kiln_")}
    labels = {name for _, pairs in kiln_series for name, _ in pairs}
    assert not labels & {"job_id", "id", "job", "prompt", "worker_id"}, labels
    label_values = {value for _, pairs in kiln_series for _, value in pairs}
    assert prompt not in label_values and not {j.id for j in jobs} & label_values
    # The panels have real data behind them: the drill, both jobs' loads, the ETA.
    assert values[("kiln_oom_total", (("model", MODEL), ("phase", "denoise"), ("rung", "full")))]
    assert values[("kiln_rung_descents_total", (("model", MODEL), ("rung", "full")))] == 1
    assert values[("kiln_loads_total", (("model", MODEL), ("source", "disk")))] >= 1
    assert values[("kiln_loads_total", (("model", MODEL), ("source", "resident")))] >= 1
    assert values[("kiln_queue_eta_seconds", (("model", MODEL),))] > 0


def test_the_dashboard_shows_every_kiln_metric() -> None:
    """A metric added to worker/queue/upkeep/metrics.py without a panel fails here."""
    metrics = ROOT / "worker" / "queue" / "upkeep" / "metrics.py"
    declared = set(re.findall(r'"(kiln_[a-z_]+)"', metrics.read_text()))
    read = {
        re.sub(r"_(bucket|sum|count)$", "", metric)
        for _, query in dashboard_queries()
        for metric in query.metrics
    }
    assert declared and declared <= read, sorted(declared - read)


def test_compose_provisions_prometheus_scraping_workers_and_grafana_with_the_dashboard() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    worker, prometheus, grafana = services["worker"], services["prometheus"], services["grafana"]

    # Prometheus reads docker/prometheus.yml and finds every worker replica on its metrics port.
    mounts = dict(_mount(v) for v in prometheus["volumes"] if v.startswith("./"))
    config_arg = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    config_path = config_arg.split("=", 1)[1]
    assert mounts[config_path] == DOCKER / "prometheus.yml"
    config = yaml.safe_load(mounts[config_path].read_text())
    (scrape_config,) = [c for c in config["scrape_configs"] if c["job_name"] == "kiln-worker"]
    (dns,) = scrape_config["dns_sd_configs"]
    assert dns["names"] == ["worker"] and dns["type"] == "A"
    assert str(dns["port"]) == str(worker["environment"]["KILN_METRICS_PORT"])

    # Grafana: its provisioning and dashboards directories exist and agree with each other.
    mounts = dict(_mount(v) for v in grafana["volumes"])
    provisioning = mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "9090:9090" in prometheus["ports"][0]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "kiln.yaml").read_text())[
        "providers"
    ]
    dashboards_at = provider["options"]["path"]
    assert mounts[dashboards_at] == DASHBOARD.parent
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards_at}/{DASHBOARD.name}"

    board = json.loads(DASHBOARD.read_text())
    uids = {p["datasource"]["uid"] for p in board["panels"]}
    uids |= {t["datasource"]["uid"] for p in board["panels"] for t in p["targets"]}
    uids |= {v["datasource"]["uid"] for v in board["templating"]["list"]}
    assert uids == {source["uid"]}
    # A job="..." matcher means Prometheus' job name for the workers.
    jobs = set(re.findall(r'job="([^"]+)"', DASHBOARD.read_text()))
    assert jobs <= {scrape_config["job_name"]}


def test_recompile_causes_become_a_fixed_set_of_labels() -> None:
    """The renderer's cause strings (LoadedPipeline.novelty's, and the LoRA swap's) map to the
    six labels, and the count of graphs each names is what the counter adds."""
    import torch
    from prometheus_client import REGISTRY

    from api_client.manifest import load_manifest_file
    from api_client.schema import SettingsReport
    from worker.pipelines.resident import LoadedPipeline
    from worker.queue.upkeep.metrics import cause_category, observe
    from worker.render.timings import TimingRecord

    def novelty(**seen: Any) -> str:
        """The cause a warm pipeline that saw one 128 px txt2img job with CFG (and, given
        adapter_sets, those adapters) names for another such job."""
        manifest = load_manifest_file(ROOT / "manifests" / f"{MODEL}.yaml")
        loaded = LoadedPipeline(manifest, None, "full", torch.float32, SettingsReport())
        loaded.modes_seen, loaded.warm_shapes, loaded.cfg_seen = (
            {"txt2img"},
            {(128, 128, 1)},
            {True},
        )
        for name, value in seen.items():
            setattr(loaded, name, value)
        return loaded.novelty(128, 128, 1, True, "txt2img")

    causes = {
        novelty(modes_seen={"img2img"}): "mode",
        novelty(warm_shapes={(192, 128, 1)}): "size",
        novelty(warm_shapes={(128, 128, 2)}): "batch",
        novelty(cfg_seen={False}): "guidance",
        novelty(adapter_sets={frozenset({"detail"})}): "adapters",
        novelty(): "other",
    }
    assert {cause: cause_category(cause) for cause in causes} == causes

    def count(cause: str) -> float:
        labels = {"model": "tiny-recompiles", "cause": cause}
        return REGISTRY.get_sample_value("kiln_recompiles_total", labels) or 0.0

    record = TimingRecord(
        job_id="j",
        model="tiny-recompiles",
        status="done",
        recompile_causes=["new size 192x128: 3 graph(s)", "guidance off (CFG ...): 1 graph(s)"],
    )
    observe(record)
    assert (count("size"), count("guidance"), count("other")) == (3.0, 1.0, 0.0)


def _mount(volume: str) -> tuple[str, Path]:
    """A compose bind mount "./host:/container[:ro]" as (container path, host path)."""
    host, container = volume.split(":")[:2]
    return container, (DOCKER / host).resolve()
