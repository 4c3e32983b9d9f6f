"""classify.serve in-process: the API against FastAPI's test client, and the micro-batch worker alone."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[serve]')")

import torch  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from classify.inference import load_run  # noqa: E402
from classify.serve.app import create_app  # noqa: E402
from classify.serve.limits import Limits  # noqa: E402
from classify.serve.microbatch import MicroBatcher, Overloaded  # noqa: E402
from classify.serve.service import ModelService  # noqa: E402

from conftest import synthetic_reviews  # noqa: E402

REVIEWS = [text for text, _ in synthetic_reviews(12, seed=5)]


@pytest.fixture(scope="module")
def service(trained_run):
    run = load_run(trained_run, torch.device("cpu"))
    return ModelService(run, Limits().max_batch, Limits().max_batch_tokens)


def client_for(service, raise_server_exceptions: bool = True, api_key: str | None = None, **limits) -> TestClient:
    return TestClient(create_app(service, Limits(**limits), api_key), raise_server_exceptions=raise_server_exceptions)


@pytest.fixture(scope="module")
def client(service):
    with client_for(service) as client:
        yield client


# ------------------------------------------------------------------------- endpoints
def test_predict_answers_each_text_in_order_with_the_models_id(client, service):
    r = client.post("/v1/predict", json={"texts": REVIEWS})
    assert r.status_code == 200
    body = r.json()
    assert body["model"] == service.id and body["model"].startswith("tiny@")
    assert len(body["predictions"]) == len(REVIEWS)
    for prediction in body["predictions"]:
        assert set(prediction["probabilities"]) == {"neg", "pos"}
        assert prediction["score"] == max(prediction["probabilities"].values())
        assert prediction["label"] == max(prediction["probabilities"], key=prediction["probabilities"].get)
    alone = [client.post("/v1/predict", json={"text": t}).json()["predictions"][0] for t in REVIEWS[:3]]
    assert [p["label"] for p in alone] == [p["label"] for p in body["predictions"][:3]]


def test_server_and_predict_cli_give_the_same_probabilities(client, trained_run, capsys):
    """One inference path: the same reviews through classify.predict --json and /v1/predict."""
    from classify.predict import main

    texts = REVIEWS + ["great " * 400]   # the last one is longer than the model's 64 positions
    # fp32 as the service here: bf16 autocast (on CPUs with AVX-512 BF16) rounds differently in batches of
    # other shapes, by about 1e-4.
    assert main(["--model", str(trained_run), "--json", "--quiet", "--precision", "fp32", *texts]) == 0
    cli = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    served = client.post("/v1/predict", json={"texts": texts}).json()["predictions"]
    for expected, got in zip(cli, served, strict=True):
        assert got["label"] == expected["label"] and got["notes"] == expected["notes"]
        assert got["probabilities"] == pytest.approx(expected["probabilities"], abs=2e-6)
    assert "truncated" in served[-1]["notes"][0]


def test_explain_gives_word_attributions_and_the_review_redrawn(client):
    r = client.post("/v1/explain", json={"text": "A great <br /> and wonderful film.", "steps": 4})
    assert r.status_code == 200
    prediction = r.json()["predictions"][0]
    explanation = prediction["explanation"]
    assert explanation["target"] == prediction["label"] == "pos"
    assert [w for w, _ in explanation["words"]] == ["A", "great", "and", "wonderful", "film."]
    assert "".join(p["text"] for p in explanation["pieces"]) == "A great and wonderful film."
    assert max(explanation["words"], key=lambda w: w[1])[0] in {"great", "wonderful"}
    weights = [p["weight"] for p in explanation["pieces"] if p["weight"] is not None]
    assert max(abs(w) for w in weights) == pytest.approx(1.0)


def test_explanations_point_towards_positive_whatever_the_answer(client):
    # A negative answer is still explained towards "pos": its negative words score below zero (drawn red).
    prediction = client.post("/v1/explain", json={"text": "An awful and boring film.", "steps": 4}).json()[
        "predictions"][0]
    assert prediction["label"] == "neg" and prediction["explanation"]["target"] == "pos"
    assert min(prediction["explanation"]["words"], key=lambda w: w[1])[0] in {"awful", "boring"}


def test_health_readiness_and_model_description(client, service):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready", "model": service.id}
    info = client.get("/v1/model").json()
    assert info["id"] == service.id and info["labels"] == ["neg", "pos"]
    assert info["sizes"]["d_model"] == 32 and info["parameters"] > 0
    assert info["training"]["config"]["epochs"] == 4 and 0.5 < info["training"]["best_val_accuracy"] <= 1
    assert 0.5 < info["test"]["accuracy"] <= 1
    assert info["runtime"]["limits"]["max_batch"] == 64 and info["runtime"]["batches"]["batches"] > 0


def test_web_page_and_openapi_docs_are_served_without_the_internet(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "v1/explain" in page.text
    assert "://" not in page.text and "src=" not in page.text   # nothing fetched from anywhere else
    assert client.get("/docs").status_code == 200
    assert set(client.get("/openapi.json").json()["paths"]) >= {"/v1/predict", "/v1/explain", "/v1/model",
                                                                "/healthz", "/readyz"}


def test_readiness_fails_when_the_worker_is_gone(service):
    with client_for(service) as client:
        client.app.state.batcher.stop()
        r = client.get("/readyz")
        assert r.status_code == 503 and "not running" in r.json()["error"]
        assert client.get("/healthz").status_code == 200


# ------------------------------------------------------------------------- bad input
JSON = {"content-type": "application/json"}
BAD_REQUESTS = {
    "not JSON": (dict(content=b"texts: great", headers=JSON), 400, "not valid JSON"),
    "not UTF-8": (dict(content=b'{"text": "caf\xe9"}', headers=JSON), 400, "not valid UTF-8"),
    "not an object": (dict(json=["a review"]), 422, "must be a JSON object"),
    "wrong type in the list": (dict(json={"texts": ["fine", 3]}), 422, "texts[1]: Input should be a valid string"),
    "texts not a list": (dict(json={"texts": "a review"}), 422, "texts: Input should be a valid list"),
    "empty list": (dict(json={"texts": []}), 422, "empty list"),
    "neither text nor texts": (dict(json={}), 422, "either 'text'"),
    "both text and texts": (dict(json={"text": "a", "texts": ["b"]}), 422, "either 'text'"),
    "unknown field": (dict(json={"txt": "a"}), 422, "unknown field 'txt'"),
    "empty text": (dict(json={"text": ""}), 422, "the text is empty"),
    "only markup": (dict(json={"texts": ["good", "<br /><br />"]}), 422, "texts[1] is empty"),
    "two empty": (dict(json={"texts": ["", "good", " "]}), 422, "texts[0], texts[2] are empty"),
    "too many texts": (dict(json={"texts": ["good"] * 257}), 422, "at most 256"),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_input_is_a_json_error_for_a_person_and_the_next_request_is_answered(client, name):
    request, status, message = BAD_REQUESTS[name]
    r = client.post("/v1/predict", **request)
    assert r.status_code == status, r.text
    assert r.json()["status"] == status and message in r.json()["error"]
    assert client.post("/v1/predict", json={"text": "good"}).status_code == 200


@pytest.mark.parametrize("request_, message", [
    ({"text": "good", "steps": 0}, "steps: Input should be greater than or equal to 1"),
    ({"text": "good", "steps": 129}, "steps: Input should be less than or equal to 128"),
    ({"texts": ["good"] * 9}, "at most 8 (its --max-explain-texts)"),
])
def test_explain_refuses_work_that_would_hold_the_worker_too_long(client, request_, message):
    r = client.post("/v1/explain", json=request_)
    assert r.status_code == 422 and message in r.json()["error"]


@pytest.mark.parametrize("method, path, status, message", [
    ("get", "/v1/nothing", 404, "there is no GET /v1/nothing"),
    ("get", "/v1/predict", 405, "GET is not allowed on /v1/predict; use POST"),
    ("delete", "/healthz", 405, "use GET"),
])
def test_unknown_routes_and_methods_are_json_errors(client, method, path, status, message):
    r = client.request(method, path)
    assert r.status_code == status and message in r.json()["error"]


def test_a_body_over_the_limit_is_413_declared_or_streamed(service):
    with client_for(service, max_body_mb=0.001) as client:   # 1,048 bytes
        r = client.post("/v1/predict", json={"text": "great " * 200})
        assert r.status_code == 413 and "over the limit of 1,048 bytes" in r.json()["error"]

        def chunks():   # no Content-Length: the limit must hold while the body streams in
            yield b'{"text": "'
            for _ in range(50):
                yield b"great " * 10
            yield b'"}'

        r = client.post("/v1/predict", content=chunks(), headers=JSON)
        assert r.status_code == 413 and "over the limit" in r.json()["error"]
        assert client.post("/v1/predict", json={"text": "good"}).status_code == 200


def test_a_5_mb_review_is_truncated_and_says_so(client):
    r = client.post("/v1/predict", json={"text": "a wonderful film " * 300_000})
    assert r.status_code == 200
    assert r.json()["predictions"][0]["notes"] == [
        "truncated: 5,100,000 characters, of which the model read 64 tokens (head+tail)"]


def test_a_failing_model_answers_500_and_the_server_keeps_serving(service):
    with client_for(service, raise_server_exceptions=False) as client:
        client.app.state.batcher.predict_fn = lambda texts: 1 / 0
        r = client.post("/v1/predict", json={"text": "good"})
        assert r.status_code == 500 and "ZeroDivisionError" in r.json()["error"]
        client.app.state.batcher.predict_fn = service.predict
        assert client.post("/v1/predict", json={"text": "good"}).status_code == 200


def test_past_the_queue_limit_a_request_gets_503_with_retry_after_and_the_server_recovers(service):
    release, held = threading.Event(), threading.Event()

    def stuck(texts):   # the model is busy with the first request until released
        held.set()
        release.wait(10)
        return service.predict(texts)

    with client_for(service, max_queue=2, max_delay_ms=0) as client, ThreadPoolExecutor(3) as pool:
        client.app.state.batcher.predict_fn = stuck
        first = pool.submit(client.post, "/v1/predict", json={"text": "good"})
        assert held.wait(10)
        queued = pool.submit(client.post, "/v1/predict", json={"texts": ["fine", "bad"]})   # 2 texts wait
        while client.app.state.batcher.waiting < 2:
            time.sleep(0.005)
        refused = client.post("/v1/predict", json={"text": "one more"})
        release.set()
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "2 texts are already waiting" in refused.json()["error"] and "--max-queue" in refused.json()["error"]
        assert first.result().status_code == 200 and queued.result().status_code == 200
        client.app.state.batcher.predict_fn = service.predict
        assert client.post("/v1/predict", json={"text": "one more"}).status_code == 200


def test_concurrent_requests_each_get_their_own_answers(client):
    expected = {t: client.post("/v1/predict", json={"text": t}).json()["predictions"][0] for t in REVIEWS}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda t: client.post("/v1/predict", json={"texts": [t, t]}).json(), REVIEWS * 3))
    for text, answer in zip(REVIEWS * 3, answers):
        for got in answer["predictions"]:
            assert got["probabilities"] == pytest.approx(expected[text]["probabilities"], abs=2e-6)


# ---------------------------------------------------------------- the micro-batcher
class GatedEcho:
    """A fake model: answers each text upper-cased, records its batches, and holds the first batch until
    released, so that the requests sent meanwhile queue up deterministically."""

    def __init__(self):
        self.batches: list[list[str]] = []
        self.release = threading.Event()

    def __call__(self, texts: list[str]) -> list[str]:
        self.batches.append(list(texts))
        if len(self.batches) == 1:
            self.release.wait(5)
        return [t.upper() for t in texts]


def run_requests(batcher: MicroBatcher, model: GatedEcho, requests: list[list[str]]) -> list[list[str]]:
    """Send the first request, then (while the model holds it) the rest, then release the model."""

    async def main():
        first = asyncio.ensure_future(batcher.predict(requests[0]))
        while not model.batches:
            await asyncio.sleep(0.005)
        rest = [asyncio.ensure_future(batcher.predict(r)) for r in requests[1:]]
        await asyncio.sleep(0.05)   # all of them queued behind the held batch
        model.release.set()
        return await asyncio.gather(first, *rest)

    batcher.start()
    try:
        return asyncio.run(main())
    finally:
        batcher.stop()


def test_batcher_answers_queued_requests_together_in_order():
    model = GatedEcho()
    requests = [[f"r{i}a", f"r{i}b"] for i in range(10)]
    answers = run_requests(MicroBatcher(model, max_batch=64, max_delay=0.0), model, requests)
    assert answers == [[t.upper() for t in r] for r in requests]
    assert [len(b) for b in model.batches] == [2, 18]   # the first alone, the 9 that queued behind it in one


def test_batcher_never_exceeds_max_batch_nor_splits_a_request():
    model = GatedEcho()
    requests = [["a"], ["b"], ["c", "d"], ["e"], ["f", "g", "h", "i"], ["j"]]
    answers = run_requests(MicroBatcher(model, max_batch=3, max_delay=0.0), model, requests)
    assert answers == [[t.upper() for t in r] for r in requests]
    assert model.batches == [["a"], ["b", "c", "d"], ["e"], ["f", "g", "h", "i"], ["j"]]


def test_batcher_with_max_batch_1_answers_one_request_at_a_time():
    model = GatedEcho()
    requests = [[str(i)] for i in range(5)]
    run_requests(MicroBatcher(model, max_batch=1, max_delay=0.05), model, requests)
    assert model.batches == requests


def test_batcher_refuses_work_past_max_queue_but_never_a_request_into_an_empty_queue():
    model = GatedEcho()
    batcher = MicroBatcher(model, max_batch=64, max_delay=0.0, max_queue=3)

    async def main():
        first = asyncio.ensure_future(batcher.predict(["a"] * 5))   # over max_queue, but nothing waits: taken
        while not model.batches:
            await asyncio.sleep(0.005)
        queued = [asyncio.ensure_future(batcher.predict(["b", "c"])), asyncio.ensure_future(batcher.predict(["d"]))]
        await asyncio.sleep(0.02)
        assert batcher.waiting == 3
        with pytest.raises(Overloaded, match="3 texts are already waiting"):
            await batcher.predict(["e"])
        with pytest.raises(Overloaded):
            await batcher.call(lambda: None, weight=1)
        model.release.set()
        answers = await asyncio.gather(first, *queued)
        assert batcher.waiting == 0
        return answers, await batcher.predict(["e"])

    batcher.start()
    try:
        answers, late = asyncio.run(main())
    finally:
        batcher.stop()
    assert answers == [["A"] * 5, ["B", "C"], ["D"]] and late == ["E"]


def test_batcher_window_opens_under_load_and_waits_no_longer_than_the_delay():
    batches: list[int] = []

    def model(texts):
        batches.append(len(texts))
        return texts

    async def timed(batcher, texts):
        start = time.monotonic()
        await batcher.predict(texts)
        return time.monotonic() - start

    async def main(batcher):
        alone = await timed(batcher, ["a"])           # no load before: runs at once, no window
        await batcher.predict(["b", "c"])             # a batch with company: the window opens
        first = asyncio.ensure_future(timed(batcher, ["d"]))
        await asyncio.sleep(0.05)                     # inside the 1 s window: joins the first request's batch
        second = asyncio.ensure_future(batcher.predict(["e"]))
        waited, _ = await asyncio.gather(first, second)
        return alone, waited

    # A long window, so that a stall of a shared CI machine (up to most of a second) changes nothing.
    batcher = MicroBatcher(model, max_batch=8, max_delay=1.0)
    batcher.start()
    try:
        alone, waited = asyncio.run(main(batcher))
    finally:
        batcher.stop()
    assert batches == [1, 2, 2] and alone < 0.5 and 0.9 < waited < 3


def test_batcher_runs_calls_alone_and_survives_a_failing_batch():
    calls = []

    def model(texts):
        if "boom" in texts:
            raise RuntimeError("model failed")
        return texts

    async def main(batcher):
        with pytest.raises(RuntimeError, match="model failed"):
            await batcher.predict(["boom"])
        value = await batcher.call(lambda: calls.append(threading.current_thread().name) or 42)
        return value, await batcher.predict(["fine"])

    batcher = MicroBatcher(model, max_batch=8, max_delay=0.0)
    batcher.start()
    try:
        assert asyncio.run(main(batcher)) == (42, ["fine"])
    finally:
        batcher.stop()
    assert calls == ["classify-batcher"] and batcher.stats.batches == 1 and not batcher.alive


# ------------------------------------------------------------------------ the command
@pytest.mark.parametrize("args, message", [
    (["--model", "{missing}", "--port", "0"], "run folder not found"),
    (["--model", "{run}", "--max-batch", "0"], "--max-batch must be positive"),
    (["--model", "{run}", "--max-delay-ms", "-1"], "--max-delay-ms must not be negative"),
    (["--model", "{run}", "--max-queue", "0"], "--max-queue must be positive"),
    (["--model", "{run}", "--port", "70000"], "--port must be between 0 and 65535"),
    (["--model", "{run}", "--workers", "0"], "--workers must be at least 1"),
    (["--model", "{run}", "--host", "203.0.113.9"], "cannot listen on 203.0.113.9 port 8000"),
])
def test_serve_command_errors_are_one_line_and_exit_2(args, message, trained_run, tmp_path, capsys):
    from classify.errors import run_cli
    from classify.serve.__main__ import main

    argv = [a.format(missing=tmp_path / "nothing", run=trained_run) for a in args]
    assert run_cli(main, argv, prog="classify.serve") == 2
    err = capsys.readouterr().err
    assert err.startswith("classify.serve: error:") and message in err and err.count("\n") == 1
