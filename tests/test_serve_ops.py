"""classify.serve for operators, in-process: /metrics, the model's version on every answer, the API key, the
warning on an exposed address, and the serve flags declared as settings."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[serve]')")

import torch  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from classify.inference import load_run  # noqa: E402
from classify.serve.app import create_app  # noqa: E402
from classify.serve.limits import Limits  # noqa: E402
from classify.serve.metrics import forget_dead_processes  # noqa: E402
from classify.serve.service import ModelService  # noqa: E402

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def service(trained_run):
    run = load_run(trained_run, torch.device("cpu"))
    return ModelService(run, Limits().max_batch, Limits().max_batch_tokens)


def client_for(service, api_key: str | None = None, **limits) -> TestClient:
    return TestClient(create_app(service, Limits(**limits), api_key), raise_server_exceptions=False)


def samples(client: TestClient) -> dict[tuple[str, frozenset], float]:
    """The /metrics exposition, parsed: (sample name, its labels) -> value."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(metrics: dict, sample: str, **labels: str) -> float:
    return metrics.get((sample, frozenset(labels.items())), 0.0)


# --------------------------------------------------------------------------- /metrics
def test_metrics_count_requests_errors_batches_and_a_rejection(service):
    release, held = threading.Event(), threading.Event()

    def stuck(texts):   # the model is busy with the first request until released, so the queue fills
        held.set()
        release.wait(10)
        return service.predict(texts)

    with client_for(service, max_queue=1, max_delay_ms=0) as client, ThreadPoolExecutor(2) as pool:
        assert client.post("/v1/predict", json={"texts": ["good", "bad"]}).status_code == 200
        assert client.post("/v1/predict", json={"texts": "not a list"}).status_code == 422
        assert client.get("/no/such/path").status_code == 404
        client.app.state.batcher.predict_fn = stuck
        first = pool.submit(client.post, "/v1/predict", json={"text": "good"})
        assert held.wait(10)
        queued = pool.submit(client.post, "/v1/predict", json={"text": "fine"})
        while client.app.state.batcher.waiting < 1:
            time.sleep(0.005)
        waiting = value(samples(client), "classify_queue_texts")
        assert client.post("/v1/predict", json={"text": "one more"}).status_code == 503
        release.set()
        assert first.result().status_code == queued.result().status_code == 200
        metrics = samples(client)

    assert waiting == 1
    predict = {"endpoint": "/v1/predict"}
    assert value(metrics, "classify_http_requests_total", **predict, method="POST", status="200") == 3
    assert value(metrics, "classify_http_requests_total", **predict, method="POST", status="422") == 1
    assert value(metrics, "classify_http_errors_total", **predict, status="422") == 1
    assert value(metrics, "classify_http_errors_total", **predict, status="503") == 1
    assert value(metrics, "classify_http_errors_total", endpoint="other", status="404") == 1   # not the raw path
    assert value(metrics, "classify_rejected_requests_total") == 1
    assert value(metrics, "classify_http_request_duration_seconds_count", **predict) == 5
    assert value(metrics, "classify_http_request_duration_seconds_bucket", **predict, le="+Inf") == 5
    assert value(metrics, "classify_batch_texts_count") == 3 and value(metrics, "classify_batch_texts_sum") == 4
    assert value(metrics, "classify_queue_texts") == 0
    identity = service.identity
    assert value(metrics, "classify_model_info", name=identity.name, version=identity.version,
                 sha256=identity.sha256) == 1


def test_with_several_workers_the_queue_of_a_dead_one_is_forgotten_and_its_counters_kept(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = int(gone.stdout), os.getpid()
    names = [f"gauge_livesum_{dead}.db", f"gauge_livesum_{alive}.db", f"counter_{dead}.db", f"gauge_max_{dead}.db"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    forget_dead_processes(str(tmp_path))
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(names[1:])


def test_metrics_count_a_failing_request_as_500_and_each_app_counts_its_own(service):
    with client_for(service) as one, client_for(service) as two:   # one process, two registries: no collision
        one.app.state.batcher.predict_fn = lambda texts: 1 / 0
        assert one.post("/v1/predict", json={"text": "good"}).status_code == 500
        assert value(samples(one), "classify_http_errors_total", endpoint="/v1/predict", status="500") == 1
        assert value(samples(two), "classify_http_errors_total", endpoint="/v1/predict", status="500") == 0


# ------------------------------------------------------------------------ the version
def test_every_answer_names_the_model_version_as_v1_model_does(service, trained_run):
    with client_for(service) as client:
        info = client.get("/v1/model").json()
        sha256 = hashlib.sha256((trained_run / "model.safetensors").read_bytes()).hexdigest()
        assert (info["name"], info["sha256"], info["version"]) == ("tiny", sha256, sha256[:12])
        assert info["id"] == f"tiny@{sha256[:12]}" == client.get("/v1/model").headers["x-model-version"]
        answers = [client.post("/v1/predict", json={"text": "good"}), client.post("/v1/predict", json={}),
                   client.get("/nothing"), client.get("/"), client.get("/healthz"), client.get("/metrics")]
        assert [a.headers.get("x-model-version") for a in answers] == [info["id"]] * len(answers)
        assert answers[0].json()["model"] == info["id"]
        client.app.state.batcher.predict_fn = lambda texts: 1 / 0   # a 500 is made outside the middleware
        failed = client.post("/v1/predict", json={"text": "good"})
        assert failed.status_code == 500 and failed.headers["x-model-version"] == info["id"]


# ------------------------------------------------------------------------ the API key
@pytest.mark.parametrize("headers, message", [
    ({}, "this API needs a key"),
    ({"Authorization": "Bearer wrong"}, "the API key is wrong"),
    ({"Authorization": f"Bearer {KEY}x"}, "the API key is wrong"),
    ({"Authorization": f"Basic {KEY}"}, "this API needs a key"),
    ({"Authorization": "Bearer "}, "this API needs a key"),
])
def test_with_a_key_the_api_refuses_requests_without_it(service, headers, message):
    with client_for(service, api_key=KEY) as client:
        for path, body in (("/v1/predict", {"text": "good"}), ("/v1/explain", {"text": "good"}),
                           ("/v1/predict", b"not even JSON")):
            r = client.post(path, headers=headers, **({"json": body} if isinstance(body, dict) else {"content": body}))
            assert r.status_code == 401 and message in r.json()["error"] and r.json()["status"] == 401
            assert r.headers["www-authenticate"].startswith("Bearer")
        assert client.get("/v1/model", headers=headers).status_code == 401


def test_with_the_right_key_the_api_answers_and_the_page_health_and_metrics_stay_open(service):
    with client_for(service, api_key=KEY) as client:
        auth = {"Authorization": f"Bearer {KEY}"}
        assert client.post("/v1/predict", json={"text": "good"}, headers=auth).status_code == 200
        assert client.get("/v1/model", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
        for path in ("/", "/healthz", "/readyz", "/metrics", "/docs"):
            assert client.get(path).status_code == 200, path
        assert value(samples(client), "classify_http_errors_total", endpoint="/v1/predict", status="401") == 0
        assert client.post("/v1/predict", json={"text": "good"}).status_code == 401
        assert value(samples(client), "classify_http_errors_total", endpoint="/v1/predict", status="401") == 1


def test_the_page_can_send_a_key_kept_in_the_browser(service):
    with client_for(service) as client:
        page = client.get("/").text
    assert 'id="api-key"' in page and "localStorage" in page and "Authorization" in page


# ----------------------------------------------------------------------- the command
@pytest.fixture
def started(monkeypatch):
    """``classify.serve``'s main, up to the point where uvicorn would serve: the app it would run."""
    import uvicorn

    apps = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: apps.append(self.config.app))
    monkeypatch.delenv("CLASSIFY_API_KEY", raising=False)
    return apps


@pytest.mark.parametrize("flags, env, warned", [
    (["--host", "0.0.0.0"], None, True),
    (["--host", "0.0.0.0", "--api-key", KEY], None, False),
    (["--host", "0.0.0.0"], KEY, False),
    (["--host", "127.0.0.1"], None, False),
])
def test_listening_beyond_this_machine_without_a_key_prints_a_warning(started, trained_run, monkeypatch, capsys,
                                                                      flags, env, warned):
    from classify.serve.__main__ import main

    if env is not None:
        monkeypatch.setenv("CLASSIFY_API_KEY", env)
    assert main(["--model", str(trained_run), "--port", "0", "--precision", "fp32", *flags]) == 0
    err = capsys.readouterr().err
    assert ("warning: listening on 0.0.0.0 without an API key" in err) == warned, err
    with TestClient(started[0]) as client:   # the key from the flag or the environment is the one required
        expected = 200 if warned or "127.0.0.1" in flags else 401
        assert client.post("/v1/predict", json={"text": "good"}).status_code == expected
        assert client.post("/v1/predict", json={"text": "good"},
                           headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
