#!/usr/bin/env python3
"""Renders the Helm chart with Helm's own Go SDK (helm-python-sdk: libhelm_c, no helm
binary) and checks what it renders:

* with release name `cache-aware-router`, the defaults plus an admin token render
  exactly the objects of deploy/kubernetes/fleet.yaml, field for field (the chart's
  config checksum annotation aside; fleet.yaml's engine Service is not the chart's);
* with `discovery.mode: kubernetes`, the RBAC objects of deploy/kubernetes/discovery-rbac.yaml;
* every values set below renders, lints clean of errors, and its config (with the admin
  Secret's layer when there is one) passes `cache-aware-router --config-check`.

    python3 -m venv /tmp/helm && /tmp/helm/bin/pip install helm-python-sdk==0.2.2
    /tmp/helm/bin/python deploy/helm/check.py --binary target/debug/cache-aware-router

Exits 1 naming every difference.
"""

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile

import helm_python as helm

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/cache-aware-router"
TOKEN = "change-me-to-a-long-random-string"

# name -> (release name, values)
CASES = {
    "fleet (defaults)": ("cache-aware-router", {"adminToken": {"value": TOKEN}}),
    "kubernetes discovery": (
        "cache-aware-router",
        {"discovery": {"mode": "kubernetes"}, "adminToken": {"value": TOKEN}},
    ),
    "static workers, external Redis, existing Secret": (
        "prod",
        {
            "discovery": {"mode": "static"},
            "workers": [{"url": "http://vllm-0:8000"}, {"url": "http://vllm-1:8000", "name": "b"}],
            "redis": {"enabled": False, "url": "redis://redis.infra:6379/2"},
            "adminToken": {"existingSecret": "router-admin"},
        },
    ),
    "one replica, no Redis": (
        "solo",
        {
            "replicaCount": 1,
            "redis": {"enabled": False},
            "shareState": False,
            "responseCache": {"enabled": False},
            "policy": "least_load",
        },
    ),
    "semantic response cache": (
        "demo",
        {
            "responseCache": {
                "semantic": {
                    "embeddings_url": "http://embedder:8000/v1/embeddings",
                    "model": "BAAI/bge-small-en-v1.5",
                    "threshold": 0.92,
                }
            }
        },
    ),
}


def docs(text):
    """The YAML documents of `text`, parsed by Helm's YAML reader (empty ones dropped)."""
    out = []
    for part in re.split(r"(?m)^---\s*$", text):
        parsed = helm.values_from_yaml(part)
        if parsed:
            out.append(parsed)
    return out


def by_name(objects):
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def render(release, values):
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name=release, namespace="default")
    return [o for text in manifests.values() for o in docs(text)]


def diff(path, a, b, out):
    """Appends to `out` each path where `a` (rendered) and `b` (shipped) differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a:
                out.append(f"{path}.{k}: only in the shipped manifest")
            elif k not in b:
                out.append(f"{path}.{k}: only in the chart's rendering")
            else:
                diff(f"{path}.{k}", a[k], b[k], out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            diff(f"{path}[{i}]", x, y, out)
    elif a != b:
        out.append(f"{path}: chart {a!r} vs shipped {b!r}")


def same_as(rendered, shipped_file, problems, label, not_the_charts=()):
    """Every rendered object equals the shipped one of its kind and name, and every
    shipped object but `not_the_charts` is rendered."""
    shipped = by_name(docs((ROOT / shipped_file).read_text()))
    for key in shipped.keys() - by_name(rendered).keys() - set(not_the_charts):
        problems.append(f"{label}: {key} of {shipped_file} is not rendered")
    for key, obj in by_name(rendered).items():
        if key not in shipped:
            problems.append(f"{label}: {key} is not in {shipped_file}")
            continue
        diff(f"{label}: {key[0]}/{key[1]}", obj, shipped[key], problems)


def config_check(binary, rendered, problems, label):
    cms = [o for o in rendered if o["kind"] == "ConfigMap"]
    secrets = [o for o in rendered if o["kind"] == "Secret"]
    if len(cms) != 1:
        problems.append(f"{label}: {len(cms)} ConfigMaps rendered, expected 1")
        return
    with tempfile.TemporaryDirectory() as d:
        args = [binary, "--config-check"]
        layers = [("config.yaml", cms[0]["data"]["config.yaml"])]
        layers += [("admin.yaml", s["stringData"]["admin.yaml"]) for s in secrets]
        for name, text in layers:
            p = pathlib.Path(d) / name
            p.write_text(text)
            args += ["-c", str(p)]
        r = subprocess.run(args, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            problems.append(f"{label}: --config-check exited {r.returncode}: {r.stderr.strip()}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", help="cache-aware-router binary for --config-check")
    a = ap.parse_args()
    problems = []
    lint = helm.lint(str(CHART))
    for e in lint["errors"]:
        problems.append(f"helm lint: {e}")
    for m in lint["messages"]:
        if m["severity"] >= 3:  # Helm's support.ErrorSev
            problems.append(f"helm lint: {m['path']}: {m['error']}")
    for label, (release, values) in CASES.items():
        try:
            rendered = render(release, values)
        except Exception as e:  # the SDK's HelmRenderError and friends
            problems.append(f"{label}: render failed: {e}")
            continue
        for o in rendered:
            o.get("spec", {}).get("template", {}).get("metadata", {}).get(
                "annotations", {}
            ).pop("checksum/config", None)
        kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in rendered)
        print(f"{label}: {len(rendered)} objects: {', '.join(kinds)}")
        if label == "fleet (defaults)":
            # The engines' headless Service is the user's, not the chart's.
            same_as(
                rendered,
                "deploy/kubernetes/fleet.yaml",
                problems,
                label,
                not_the_charts=[("Service", "vllm")],
            )
        if label == "kubernetes discovery":
            rbac = [o for o in rendered if o["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
            if len(rbac) != 3:
                problems.append(f"{label}: {len(rbac)} RBAC objects rendered, expected 3")
            same_as(rbac, "deploy/kubernetes/discovery-rbac.yaml", problems, label)
        if a.binary:
            config_check(a.binary, rendered, problems, label)
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    if problems:
        sys.exit(1)
    print(f"helm chart: {len(CASES)} value sets rendered and checked")


if __name__ == "__main__":
    main()
