"""The console in a real headless Chromium (Selenium), against a real server on loopback: the pages load
clean, a chat streams in with its TTFT, Stop aborts and the server frees the blocks, the KV map shows shared
blocks, and the API key is asked for. Screenshots of each page go to the test's temp dir, and also to
$KVSERVE_CONSOLE_SCREENSHOTS when set (the README's come from there)."""

import os
import re
import shutil
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

from tests.browser import console_errors, headless_chromium, save_screenshot, wait_until
from tests.server_harness import TINY_MODEL, assert_nothing_allocated, slow_down_steps, tiny_server, wait_for

SCREENSHOTS_ENV = "KVSERVE_CONSOLE_SCREENSHOTS"
API_KEY = "console-key"
BLOCK_SIZE = 16
PREFIX = [5 + (7 * i) % 400 for i in range(5 * BLOCK_SIZE)]  # five full blocks two prompts share
SHARED_RGB = [76, 29, 149]  # kvmap.js's colour for shared blocks


@pytest.fixture(scope="module")
def browser():
    with headless_chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def console_server(tiny_checkpoints):
    with tiny_server(tiny_checkpoints) as running:
        yield running


def _screenshot(driver, tmp_path: Path, name: str) -> None:
    path = save_screenshot(driver, tmp_path / "screenshots", name)
    if os.environ.get(SCREENSHOTS_ENV):
        Path(os.environ[SCREENSHOTS_ENV]).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(os.environ[SCREENSHOTS_ENV]) / path.name)


def _text(driver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def _model_options(driver) -> list[str]:
    return [option.get_attribute("value") for option in driver.find_elements(By.CSS_SELECTOR, "#model option")]


def _open(driver, base_url: str, view: str) -> None:
    """The console on `view`, once it has its model list (and, for the polled views, a first snapshot)."""
    driver.get(f"{base_url}/console/#{view}")
    driver.refresh()  # a hash change alone does not reload the page
    wait_until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"), "the model list never loaded")
    if view != "playground":
        wait_until(driver, lambda d: _text(d, "status").startswith("updated"), "the view never got the state")


def _fill(driver, values: dict[str, str]) -> None:
    for element_id, value in values.items():
        field = driver.find_element(By.ID, element_id)
        field.clear()
        field.send_keys(value)


def _send(driver, prompt: str) -> None:
    driver.find_element(By.ID, "prompt").send_keys(prompt)
    driver.find_element(By.ID, "send").click()


def _last_answer_stats(driver) -> dict[str, str]:
    """The last answer's stats line by part (ttft, rate, tokens, finish), once it is shown."""
    stats = wait_until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".turn.assistant:last-child .stats"),
                       "the answer never finished")  # fmt: skip
    return {part.get_attribute("class"): part.text for part in stats[0].find_elements(By.TAG_NAME, "span")}


def _last_answer_text(driver) -> str:
    element = driver.find_element(By.CSS_SELECTOR, ".turn.assistant:last-child .text")
    return driver.execute_script("return arguments[0].textContent", element)


def test_each_page_loads_without_console_errors(browser, console_server):
    browser.get(f"{console_server.base_url}/")
    wait_until(browser, lambda d: _text(d, "status") == "connected", "the console never reached the API")
    assert browser.current_url == f"{console_server.base_url}/console/"
    assert _model_options(browser) == [TINY_MODEL]
    for view in ("live", "kv", "playground"):
        browser.find_element(By.CSS_SELECTOR, f'nav a[data-view="{view}"]').click()
        for other in ("playground", "live", "kv"):
            assert browser.find_element(By.ID, f"view-{other}").is_displayed() == (other == view)
    browser.find_element(By.CSS_SELECTOR, 'nav a[data-view="kv"]').click()
    num_blocks = console_server.engine.core.scheduler.allocator.num_blocks
    wait_until(browser, lambda d: _text(d, "kv-free") == str(num_blocks), "the map never showed the free pool")
    assert _text(browser, "kv-total") == f"{num_blocks} blocks of {BLOCK_SIZE} slots"
    assert console_errors(browser) == []


def test_a_chat_streams_into_the_page_with_its_ttft_and_says_what_the_api_says(
    browser, console_server, monkeypatch, tmp_path
):
    slow_down_steps(console_server, monkeypatch)
    _open(browser, console_server.base_url, "playground")
    _fill(browser, {"max-tokens": "40", "temperature": "0", "seed": "3"})
    # Every length the answer's text takes as the page renders it: streamed text arrives in pieces.
    browser.execute_script("""
        window.answerLengths = [];
        new MutationObserver(() => {
          const answer = document.querySelector(".turn.assistant:last-child .text");
          if (answer) window.answerLengths.push(answer.textContent.length);
        }).observe(document.getElementById("transcript"), {subtree: true, childList: true, characterData: true});
    """)
    _send(browser, "Hello there")
    stats = _last_answer_stats(browser)
    text = _last_answer_text(browser)

    client = OpenAI(base_url=f"{console_server.base_url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Hello there"}]
    expected = client.chat.completions.create(model=TINY_MODEL, messages=messages, max_tokens=40, temperature=0,
                                              seed=3)  # fmt: skip
    assert text == expected.choices[0].message.content
    assert stats["finish"] == f"finish: {expected.choices[0].finish_reason}"
    assert stats["tokens"] == f"{expected.usage.completion_tokens} tokens"
    assert re.fullmatch(r"TTFT \d+ ms", stats["ttft"]) and re.fullmatch(r"[\d.]+ tokens/s", stats["rate"])
    lengths = browser.execute_script("return window.answerLengths")
    assert len({length for length in lengths if 0 < length < len(text)}) >= 2, "the answer did not stream in"

    # The next turn carries the conversation so far.
    _send(browser, "And then?")
    _last_answer_stats(browser)
    wait_until(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".turn.assistant .stats")) == 2, "no 2nd")
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    expected = client.chat.completions.create(model=TINY_MODEL, messages=messages, max_tokens=40, temperature=0,
                                              seed=3)  # fmt: skip
    assert _last_answer_text(browser) == expected.choices[0].message.content
    _screenshot(browser, tmp_path, "playground")
    assert console_errors(browser) == []


def test_a_completion_streams_and_an_api_error_shows_the_apis_message(browser, console_server):
    _open(browser, console_server.base_url, "playground")
    browser.find_element(By.CSS_SELECTOR, 'input[name="mode"][value="completion"]').click()
    _fill(browser, {"max-tokens": "8", "temperature": "0"})
    _send(browser, "Once upon a time")
    stats = _last_answer_stats(browser)
    body = {"model": TINY_MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    expected = httpx.post(f"{console_server.base_url}/v1/completions", json=body).json()
    assert _last_answer_text(browser) == expected["choices"][0]["text"]
    assert stats["tokens"] == f"{expected['usage']['completion_tokens']} tokens"
    assert stats["finish"] == f"finish: {expected['choices'][0]['finish_reason']}"

    _fill(browser, {"max-tokens": "100000"})
    _send(browser, "Once upon a time")
    refused = httpx.post(f"{console_server.base_url}/v1/completions",
                         json={"model": TINY_MODEL, "prompt": "Once upon a time", "max_tokens": 100000})  # fmt: skip
    assert refused.status_code == 400
    error = wait_until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".turn.assistant:last-child .api-error"),
                       "the error was not shown")  # fmt: skip
    assert error[0].text == refused.json()["error"]["message"]
    assert browser.find_element(By.ID, "send").is_enabled()
    assert all("status of 400" in message for message in console_errors(browser))  # the refused fetch, nothing else


def test_stop_aborts_the_request_and_the_server_frees_its_blocks(browser, console_server, monkeypatch):
    slow_down_steps(console_server, monkeypatch, delay_s=0.05)  # 400 tokens would take 20 s
    aborted_before = console_server.metric("requests_finished_total", finished_reason="abort") or 0
    _open(browser, console_server.base_url, "playground")
    _fill(browser, {"max-tokens": "400", "temperature": "0", "seed": "1"})
    _send(browser, "Tell me a long story")
    wait_until(browser, lambda d: _last_answer_text(d), "no text arrived")
    assert console_server.engine.has_unfinished() and console_server.engine.kv_usage().num_used_blocks > 0

    browser.find_element(By.ID, "stop").click()
    stats = _last_answer_stats(browser)
    assert stats["finish"] == "finish: stopped"
    wait_for(lambda: console_server.metric("requests_finished_total", finished_reason="abort") == aborted_before + 1)
    assert_nothing_allocated(console_server)
    assert browser.find_element(By.ID, "send").is_enabled() and not browser.find_element(By.ID, "stop").is_enabled()
    assert console_errors(browser) == []


def _cell_centre(browser, canvas, block_id: int) -> tuple[int, int]:
    """Where block `block_id`'s cell is, in CSS pixels from the canvas's top left, from the layout it drew."""
    layout = {key: int(canvas.get_attribute(f"data-{key}")) for key in ("cell-px", "columns", "blocks-per-cell")}
    cell = block_id // layout["blocks-per-cell"]
    size = layout["cell-px"]
    return (cell % layout["columns"]) * size + size // 2, (cell // layout["columns"]) * size + size // 2


def test_the_map_shows_blocks_two_requests_share_with_their_ref_count(browser, console_server, monkeypatch, tmp_path):
    slow_down_steps(console_server, monkeypatch, delay_s=0.02)
    with httpx.Client(base_url=console_server.base_url, timeout=30) as client, ExitStack() as streams:
        for suffix in ([1, 2, 3], [4, 5]):
            body = {"model": TINY_MODEL, "prompt": [*PREFIX, *suffix], "max_tokens": 400, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            lines = streams.enter_context(client.stream("POST", "/v1/completions", json=body)).iter_lines()
            streams.callback(lines.close)
            next(lines)  # its first token: the prefix is computed (and, for the first, cached for the second)

        _open(browser, console_server.base_url, "kv")
        wait_until(browser, lambda d: _text(d, "kv-shared") == "5", "the map never showed the 5 shared blocks")
        state = client.get("/v1/engine/state").json()
        shared_block, ref_count = state["kv_cache"]["shared"][0]
        assert ref_count == 2
        canvas = browser.find_element(By.ID, "kv-canvas")
        x, y = _cell_centre(browser, canvas, shared_block)
        rgb = browser.execute_script(
            "const c = arguments[0], r = window.devicePixelRatio;"
            "return Array.from(c.getContext('2d').getImageData(arguments[1] * r, arguments[2] * r, 1, 1).data)",
            canvas, x, y,
        )  # fmt: skip
        assert rgb[:3] == SHARED_RGB
        ActionChains(browser).move_to_element_with_offset(canvas, x - canvas.size["width"] // 2,
                                                          y - canvas.size["height"] // 2).perform()  # fmt: skip
        hover = wait_until(browser, lambda d: _text(d, "kv-hover").startswith(f"block {shared_block}:"), "no hover")
        assert hover and f"block {shared_block}: shared, ref count 2" in _text(browser, "kv-hover")

        assert len(browser.find_elements(By.CSS_SELECTOR, "#kv-requests tr")) == 2

        def hover_first_request(driver) -> bool:
            row = driver.find_element(By.CSS_SELECTOR, "#kv-requests tr")
            ActionChains(driver).move_to_element(row).perform()
            return "highlighted" in row.get_attribute("class")

        wait_until(browser, hover_first_request, "hovering a request did not highlight it")
        _screenshot(browser, tmp_path, "kv-cache")

        browser.find_element(By.CSS_SELECTOR, 'nav a[data-view="live"]').click()
        wait_until(browser, lambda d: _text(d, "live-running") == "2", "the live view never showed 2 running")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#live-requests tr")) == 2
        _screenshot(browser, tmp_path, "live")
    assert console_errors(browser) == []


def test_the_live_view_shows_each_running_requests_priority_and_the_waiting_ones_by_priority(
    browser, tiny_checkpoints, monkeypatch
):
    """Under the priority policy, one seat: a request at priority 1 runs; two at 3 and 5 wait behind it."""
    with tiny_server(tiny_checkpoints, scheduling_policy="priority", max_num_seqs=1) as running, ExitStack() as streams:
        slow_down_steps(running, monkeypatch, delay_s=0.02)
        client = streams.enter_context(httpx.Client(base_url=running.base_url, timeout=30))
        for priority in (1, 3, 5):
            body = {"model": TINY_MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                    "stream": True, "priority": priority}  # fmt: skip
            lines = streams.enter_context(client.stream("POST", "/v1/completions", json=body)).iter_lines()
            streams.callback(lines.close)
            if priority == 1:
                next(lines)  # its first token: it holds the seat
        wait_for(lambda: running.ctx.engine.num_waiting == 2)

        _open(browser, running.base_url, "live")
        wait_until(browser, lambda d: _text(d, "live-waiting") == "2 (1 at 3, 1 at 5)", "no waiting by priority")
        cells = browser.find_elements(By.CSS_SELECTOR, "#live-requests tr td")
        assert [cell.text for cell in cells[:2]] == [running.engine.core.scheduler.running[0].request_id, "1"]
    assert console_errors(browser) == []


def test_with_an_api_key_the_page_asks_for_it_and_works_once_it_is_entered(browser, tiny_checkpoints, tmp_path):
    with tiny_server(tiny_checkpoints, api_key=API_KEY) as running:
        browser.get(f"{running.base_url}/console/#live")
        dialog = browser.find_element(By.ID, "key-dialog")
        wait_until(browser, lambda d: dialog.get_attribute("open") is not None, "the page never asked for the key")
        _screenshot(browser, tmp_path, "api-key")
        browser.find_element(By.ID, "key-input").send_keys("wrong-key")
        browser.find_element(By.ID, "key-submit").click()
        wait_until(browser, lambda d: _text(d, "key-error") == "That key was refused.", "a wrong key was not refused")
        assert dialog.get_attribute("open") is not None

        browser.find_element(By.ID, "key-input").send_keys(API_KEY)
        browser.find_element(By.ID, "key-submit").click()
        wait_until(browser, lambda d: _text(d, "status").startswith("updated"), "the live view never updated")
        assert dialog.get_attribute("open") is None
        assert _model_options(browser) == [TINY_MODEL]
        assert browser.execute_script("return sessionStorage.getItem('kvserve.apiKey')") == API_KEY
        assert all("status of 401" in message for message in console_errors(browser))  # the refused calls only
        browser.execute_script("sessionStorage.clear()")


# A state of `numBlocks` blocks: the first `numHeld` held by 256 requests in equal runs, every 10th of those
# blocks shared, then a run of evictable blocks, the rest free; drawn by the console's own KVMapView.
_DRAW_SYNTHETIC_MAP = """
const [numBlocks, numHeld, done] = arguments;
import("/console/kvmap.js").then(({ KVMapView, requestColour }) => {
  const states = new Uint8Array(numBlocks);
  const running = [];
  const perRequest = numHeld / 256;
  for (let r = 0; r < 256; r++) {
    const start = r * perRequest;
    running.push({ request_id: `req-${r}`, num_prompt_tokens: 1, num_output_tokens: 1, num_computed_tokens: 1,
                   block_ranges: [[start, start + perRequest]], num_preemptions: 0, num_unfilled_slots: 5 });
    states.fill(1, start, start + perRequest);
  }
  const shared = [];
  for (let b = 0; b < numHeld; b += 10) { states[b] = 2; shared.push([b, 2]); }
  states.fill(3, numHeld, numHeld + 1000);
  const names = ["free", "held", "shared", "evictable"];
  const count = (s) => states.reduce((n, x) => n + (x === s), 0);
  const kv = { block_size: 16, state_names: names, encoding: "base64",
               states: btoa(Array.from(states, (x) => String.fromCharCode(x)).join("")), shared,
               blocks: { total: numBlocks, free: count(0), held: count(1), shared: count(2), evictable: count(3),
                         used: numHeld, available: numBlocks - numHeld },
               num_live_tokens: 0, num_unfilled_slots: 5 * 256, slot_utilization: 1, fragmentation: 0,
               prefix_cache_hit_rate: null };
  const state = { kv_cache: kv, requests: { running, num_waiting: 0, num_preempted_waiting: 0 } };
  const section = document.getElementById("view-kv");
  const view = new KVMapView(section);
  const started = performance.now();
  view.update(state);
  const elapsed = performance.now() - started;
  const canvas = document.getElementById("kv-canvas");
  const image = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height);  // one readback
  const pixel = (x, y) => Array.from(image.data.slice((y * canvas.width + x) * 4, (y * canvas.width + x) * 4 + 3));
  done({ elapsedMs: elapsed, layout: view.layout, firstCell: pixel(0, 0), request0: requestColour(0),
         free: _text("kv-free"), scale: _text("kv-scale") });
  function _text(id) { return document.getElementById(id).textContent; }
});
"""


@pytest.mark.parametrize("num_blocks", [100_000, 1_000_000])
def test_the_map_draws_a_huge_pool_aggregating_blocks_when_they_outnumber_pixels(browser, console_server, num_blocks):
    _open(browser, console_server.base_url, "kv")
    browser.execute_script("location.hash = '#playground'")  # stop the live polls from redrawing the map
    browser.execute_script("document.getElementById('view-kv').hidden = false")
    num_held = 256 * 200
    result = browser.execute_async_script(_DRAW_SYNTHETIC_MAP, num_blocks, num_held)
    layout = result["layout"]
    print(f"{num_blocks} blocks, 256 requests: drawn in {result['elapsedMs']:.1f} ms, layout {layout}")
    assert layout["columns"] * layout["rows"] * layout["blocksPerCell"] >= num_blocks
    assert layout["numCells"] <= layout["columns"] * layout["rows"] < layout["numCells"] + layout["columns"]
    if num_blocks == 100_000:  # fewer blocks than pixels: a cell a block, big enough to see
        assert layout["blocksPerCell"] == 1 and layout["cellPx"] >= 2
        assert result["scale"] == "one cell: one block"
        # Block 0 is shared (every 10th held block is), so its cell has the shared colour.
        assert result["firstCell"] == SHARED_RGB
    else:  # more blocks than pixels: each cell averages its blocks' colours
        assert layout["blocksPerCell"] > 1 and layout["cellPx"] == 1
        assert result["scale"] == f"one cell: {layout['blocksPerCell']} blocks (average colour)"
        blocks = layout["blocksPerCell"]  # the first cell: block 0 shared, the rest held by request 0
        expected = [round((SHARED_RGB[i] + (blocks - 1) * result["request0"][i]) / blocks) for i in range(3)]
        assert all(abs(got - want) <= 1 for got, want in zip(result["firstCell"], expected, strict=True))
    assert result["free"] == str(num_blocks - num_held - 1000)
    assert console_errors(browser) == []
