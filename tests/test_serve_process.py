"""classify.serve as a real process: HTTP over TCP under concurrency, the load generator, and the web page in
a real browser (Debian's Chromium driven by Playwright)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="the serve extra is not installed (pip install -e '.[serve]')")

from conftest import synthetic_reviews  # noqa: E402
from experiments.serve_load import main as load_main  # noqa: E402
from experiments.serve_load import serve_process  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.slow
CHROMIUM = Path(os.environ.get("CLASSIFY_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update"]


@pytest.fixture(scope="module")
def server(trained_run):
    # A batching window long enough that concurrent test requests share batches; fp32, because bf16 autocast
    # (on CPUs with AVX-512 BF16) rounds a review differently alone than in a batch, by about 1e-4.
    with serve_process(trained_run, "--threads", "1", "--max-delay-ms", "20", "--log-level", "warning",
                       "--precision", "fp32") as url:
        yield url


def test_real_server_answers_concurrent_clients_each_their_own(server):
    texts = [text for text, _ in synthetic_reviews(32, seed=7)]
    expected = [httpx.post(f"{server}/v1/predict", json={"text": t}).json()["predictions"][0] for t in texts]

    async def send_all():
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(client.post(f"{server}/v1/predict", json={"text": t}) for t in texts))

    answers = asyncio.run(send_all())
    assert [a.status_code for a in answers] == [200] * len(texts)
    for want, got in zip(expected, answers):
        assert got.json()["predictions"][0]["probabilities"] == pytest.approx(want["probabilities"], abs=2e-6)
    assert httpx.get(f"{server}/v1/model").json()["runtime"]["batches"]["largest"] > 1
    assert httpx.get(f"{server}/readyz").json()["status"] == "ready"


def test_workers_share_the_port_add_up_their_metrics_and_a_dead_worker_is_replaced(trained_run):
    # A fresh connection for each request: the kernel hands each to one of the workers waiting on the socket.
    # The supervisor listens before its workers have loaded the model, so the first requests wait in the
    # socket's backlog for as long as a worker takes to start: seconds on a busy machine, past httpx's default 5 s.
    fresh = httpx.Client(headers={"Connection": "close"}, timeout=60)

    def processes(url: str, tries: int = 40) -> set[int]:
        return {fresh.get(f"{url}/v1/model").json()["runtime"]["process"] for _ in range(tries)}

    def predict(url: str) -> dict:
        return fresh.post(f"{url}/v1/predict", json={"text": text}).json()

    def scrape(url: str) -> dict[str, list]:
        """/metrics on a fresh connection (any worker may answer): sample name -> [(labels, value)]."""
        found: dict[str, list] = {}
        for family in text_string_to_metric_families(fresh.get(f"{url}/metrics").text):
            for sample in family.samples:
                found.setdefault(sample.name, []).append((sample.labels, sample.value))
        return found

    def predictions(metrics: dict[str, list]) -> float:
        return sum(v for labels, v in metrics["classify_http_requests_total"]
                   if labels == {"endpoint": "/v1/predict", "method": "POST", "status": "200"})

    text = "A warm, funny and wonderfully acted film."
    with fresh, serve_process(trained_run, "--threads", "1", "--workers", "2", "--log-level", "warning",
                              "--precision", "fp32") as url:
        workers: set[int] = set()
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline:   # each worker loads the model once started
            workers |= processes(url, 10)
        assert len(workers) == 2
        answer = [predict(url)["predictions"][0] for _ in range(6)][0]
        for _ in range(6):   # whichever worker answers the scrape, it counts the requests both answered
            metrics = scrape(url)
            assert predictions(metrics) == 6
            assert [v for _, v in metrics["classify_queue_texts"]] == [0]   # one series, not one per worker
            assert [v for _, v in metrics["classify_model_info"]] == [1]
        os.kill(min(workers), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (now := processes(url, 10)) - workers and time.monotonic() < deadline:
            time.sleep(0.5)   # the supervisor checks its workers every half second, then loads the replacement
        assert now - workers                                  # a new worker answers ...
        assert processes(url) == {max(workers), *(now - workers)}   # ... beside the one that lived
        again = predict(url)["predictions"][0]
        assert again["probabilities"] == pytest.approx(answer["probabilities"], abs=1e-6)
        metrics = scrape(url)
        assert predictions(metrics) == 7   # the dead worker's requests still count: a counter never goes down
        assert [v for _, v in metrics["classify_queue_texts"]] == [0]


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_server_lets_idle_torch_threads_sleep_unless_told_otherwise(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": given} if given else {})
    code = "import os, classify.serve.__main__, torch; print(os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == expected, out.stderr


def test_load_generator_records_every_mode_without_failures(trained_run, parquet_data, tmp_path):
    out = tmp_path / "serve_load"
    assert load_main(["--model", str(trained_run), "--data", str(parquet_data / "test.parquet"), "--requests", "12",
                      "--rounds", "2", "--clients", "1", "8", "--threads", "1", "--output", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert set(result["runs"]) == {"1"} and set(result["runs"]["1"]) == {"on", "on-nowait", "off"}
    for levels in result["runs"]["1"].values():
        assert [lv["clients"] for lv in levels] == [1, 8]
        assert all(lv["requests"] == 2 * max(12, 3 * lv["clients"]) and lv["failures"] == 0
                   and lv["requests_per_s"] > 0 for lv in levels)
    assert all(lv["mean_batch"] == 1 for lv in result["runs"]["1"]["off"])
    markdown = out.with_suffix(".md").read_text()
    assert "| 1 | on | 8 |" in markdown and "| 1 | on-nowait | 8 |" in markdown
    reference = result["compute_reference"][0]
    assert reference["threads"] == 1 and reference["one_at_a_time_ms"] > 0 and reference["batched_ms"] > 0


def test_open_loop_load_test_records_capacity_levels_and_efficiency(trained_run, parquet_data, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)   # the load test's own threads: libgomp's default
    out = tmp_path / "open_loop"
    assert load_main(["--model", str(trained_run), "--data", str(parquet_data / "test.parquet"), "--threads", "1",
                      "--open-loop", "0.5", "0.8", "--seconds", "1", "--requests", "16", "--rounds", "1",
                      "--capacity-clients", "4", "--precision", "fp32", "--max-delay-ms", "0",
                      "--output", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    run = result["runs"]["--threads 1 --workers 1 --max-delay-ms 0"]
    assert run["threads"] == 1 and run["max_delay_ms"] == 0   # the server ran the window it was given
    assert run["capacity"]["failures"] == 0 and run["capacity"]["requests_per_s"] > 0
    assert [lv["fraction"] for lv in run["open_loop"]] == [0.5, 0.8]
    for level in run["open_loop"]:
        # A one-second level on a shared machine can meet a stall of the load generator; the burst that follows
        # may fill the server's queue, which then sheds load with 503s. Anything else is a wrong request.
        assert set(level["failure_kinds"]) <= {"503"} and sum(level["failure_kinds"].values()) == level["failures"]
        assert level["requests"] >= 1 and level["served_per_s"] > 0 and level["p50_ms"] <= level["p99_ms"]
        assert level["target_per_s"] == pytest.approx(level["fraction"] * run["capacity"]["requests_per_s"], abs=0.1)
    assert run["model_alone"]["precision"] == "fp32" and run["model_alone"]["reviews_per_s"] > 0
    assert run["efficiency"] == pytest.approx(run["capacity"]["requests_per_s"] / run["model_alone"]["reviews_per_s"],
                                              abs=1e-3)
    # The server's threads sleep (PASSIVE) where the reference's spin: the model alone is also run as served.
    assert run["model_alone"]["wait_policy"] is None
    as_served = run["model_alone_as_served"]
    assert as_served["wait_policy"] == "PASSIVE" and as_served["reviews_per_s"] > 0
    assert run["efficiency_as_served"] == pytest.approx(run["capacity"]["requests_per_s"] / as_served["reviews_per_s"],
                                                        abs=1e-3)
    markdown = out.with_suffix(".md").read_text()
    assert "| 80% |" in markdown and "(OMP_WAIT_POLICY=PASSIVE)" in markdown and result["cpu_flags"] is not None


def test_open_loop_load_test_drives_an_onnx_server_and_its_model_alone(int8_export, parquet_data, tmp_path):
    """--backend onnx: the server runs an int8 export on ONNX Runtime, and the reference runs the same export."""
    out = tmp_path / "open_loop_onnx"
    assert load_main(["--model", str(int8_export), "--data", str(parquet_data / "test.parquet"),
                      "--threads", "1", "--open-loop", "0.5", "--seconds", "1", "--requests", "16", "--rounds", "1",
                      "--capacity-clients", "4", "--backend", "onnx", "--output", str(out)]) == 0
    run = json.loads(out.with_suffix(".json").read_text())["runs"]["--threads 1 --workers 1"]
    assert run["capacity"]["failures"] == 0 and set(run["open_loop"][0]["failure_kinds"]) <= {"503"}
    assert run["open_loop"][0]["served_per_s"] > 0
    assert run["model_alone"]["reviews_per_s"] > 0 and run["model_alone"]["precision"] == "int8"
    assert "model_alone_as_served" not in run   # ONNX Runtime's threads are its own: no OpenMP policy to compare


# --------------------------------------------------------------------- real browser
@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: the real-browser test of the web page did not run "
                    f"(apt-get install -y chromium, or set CLASSIFY_CHROMIUM to a Chromium binary)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def page(server, browser):
    page = browser.new_page()
    page.goto(server + "/")
    return page


def test_web_page_classifies_a_review_and_shades_its_words(page, tmp_path):
    page.fill("#text", "A wonderful film, superb and moving. I loved the cast.")
    page.click("#classify")
    page.wait_for_selector("#result:not([hidden])", timeout=15_000)
    assert page.inner_text("#label").startswith("pos (")
    assert page.is_hidden("#error")
    width = page.eval_on_selector("#bar", "bar => parseFloat(bar.style.width)")
    assert 50 <= width <= 100
    shaded = page.eval_on_selector_all("#review span.w", "spans => spans.map(s => [s.textContent, "
                                                         "getComputedStyle(s).backgroundColor])")
    assert [word for word, _ in shaded][:2] == ["A", "wonderful"]
    assert any(color not in ("rgb(255, 255, 255)", "rgba(0, 0, 0, 0)") for _, color in shaded)
    assert page.inner_text("#model").startswith("tiny@")
    page.screenshot(path=str(tmp_path / "classified.png"), full_page=True)


def test_web_page_ctrl_enter_and_examples_classify_too(page):
    page.fill("#text", "Awful, boring and stupid: the worst film, a waste of time.")
    page.press("#text", "Control+Enter")
    page.wait_for_function("document.querySelector('#label').textContent.startsWith('neg')", timeout=15_000)
    page.click("#examples button:has-text('Loved it')")
    page.wait_for_function("document.querySelector('#text').value.startsWith('One of the best')", timeout=15_000)
    page.wait_for_function("!document.querySelector('#classify').disabled", timeout=15_000)
    assert page.is_visible("#result")


def test_web_page_shows_an_empty_review_as_an_error_in_words(page):
    page.fill("#text", "")
    page.click("#classify")
    page.wait_for_selector("#error:not([hidden])", timeout=15_000)
    assert "the text is empty" in page.inner_text("#error")
    assert page.is_hidden("#result")


def test_web_page_sends_the_api_key_it_keeps_in_the_browser(trained_run, browser):
    with serve_process(trained_run, "--threads", "1", "--log-level", "warning", "--api-key", "page-key") as url:
        page = browser.new_page()
        page.goto(url + "/")
        page.fill("#text", "A wonderful film.")
        page.click("#classify")
        page.wait_for_selector("#error:not([hidden])", timeout=15_000)
        assert "needs a key" in page.inner_text("#error")
        page.fill("#api-key", "page-key")
        page.dispatch_event("#api-key", "change")
        page.click("#classify")
        page.wait_for_selector("#result:not([hidden])", timeout=15_000)
        assert page.inner_text("#label").startswith("pos (")
        page.reload()   # kept in localStorage: the next visit sends it without asking again
        assert page.input_value("#api-key") == "page-key"
        page.wait_for_function("document.querySelector('#model').textContent.startsWith('tiny@')", timeout=15_000)
