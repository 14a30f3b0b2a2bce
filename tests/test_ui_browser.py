"""The real Dagster UI in headless Chromium: `train` launched from the Launchpad, then its pages read as a user would.

`dagster dev` serves workspace.yaml on a free local port with a temporary DAGSTER_HOME; Debian's chromium, driven
by playwright (its wheel bundles its node driver; no browser is downloaded), pastes a 2-step run config into the
Launchpad's editor and clicks Launch Run. Once the run has succeeded, the tests open the rollouts asset's
partitions and one partition's metadata, and the run's plots on the `training_runs` asset, assert what the pages
show and save screenshots under the test's tmp directory (and under $MARL_UI_SCREENSHOTS, when set: how
docs/ui-run-plots.png was made).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from assets.partitions import stage_partition
from tests.conftest import ROOT, hybrid_agents, small_config_data

CHROMIUM = os.environ.get("MARL_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
RUN = "ui"
STEPS, MICRO_BATCHES = 2, 2
LOCATION = "assets.definitions:defs"  # workspace.yaml's code location, as the UI names it
RUN_TIMEOUT_S = 1500  # a 2-step run with warm-up and evaluation: ~3 minutes alone, far more on a busy machine

try:
    from playwright.sync_api import Page, expect, sync_playwright

    # A busy 2-core machine: the UI's first GraphQL answers can take longer than expect's default 5 s.
    expect.set_options(timeout=60_000)
except ImportError:  # pragma: no cover - the dev extra installs it
    sync_playwright = None

pytestmark = [
    pytest.mark.launch,
    pytest.mark.timeout(RUN_TIMEOUT_S + 900),  # the first test's set-up starts the UI and waits for the run
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed: run `make setup` (dev extra)"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason=f"no Chromium at {CHROMIUM}: install Debian's with `apt-get install chromium` "
                              "(scripts/setup.sh does, as root), or point MARL_CHROMIUM at one"),
]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _graphql(url: str, query: str) -> dict:
    request = urllib.request.Request(f"{url}/graphql", data=json.dumps({"query": query}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["data"]


@pytest.fixture(scope="module")
def dagster_ui(tmp_path_factory):
    """`dagster dev` (webserver, daemon, code server) on a free port with its own DAGSTER_HOME; stopped after."""
    work = tmp_path_factory.mktemp("ui")
    home = work / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = (work / "dagster_dev.log").open("w")
    env = {**os.environ, "DAGSTER_HOME": str(home), "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    # Its own session, so teardown reaches every process it started. SIGINT stops it even in a background run:
    # conftest.py restores SIGINT's default there, which it inherits (dagster dev maps SIGTERM to SIGINT's handler).
    server = subprocess.Popen([str(Path(sys.executable).parent / "dagster"), "dev", "-w", "workspace.yaml",
                               "-h", "127.0.0.1", "-p", str(port)], cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                pytest.fail(f"dagster dev exited with {server.returncode}:\n{_tail(work / 'dagster_dev.log')}")
            try:
                if _code_location_loaded(url):
                    break
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                pytest.fail(f"dagster dev did not serve {LOCATION} in 300 s:\n{_tail(work / 'dagster_dev.log')}")
            time.sleep(2)
        yield {"url": url, "work": work, "log": work / "dagster_dev.log"}
    finally:
        _stop(server)
        log.close()


def _code_location_loaded(url: str) -> bool:
    data = _graphql(url, "{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus "
                         "locationOrLoadError { __typename ... on PythonError { message } } } } } }")
    for entry in data["workspaceOrError"]["locationEntries"]:
        if entry["name"] == LOCATION and entry["loadStatus"] == "LOADED":
            if entry["locationOrLoadError"]["__typename"] == "PythonError":
                pytest.fail(f"the code location failed to load: {entry['locationOrLoadError']['message']}")
            return True
    return False


def _stop(server: subprocess.Popen) -> None:
    """Ctrl+C to dagster dev (it stops its webserver, daemon and code server), then SIGKILL to whatever of its
    process group is left (a run still going after a failed test, its Ray)."""
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the whole group has exited
    server.wait(timeout=30)


def _tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        # Debian's build, never one playwright would download; headless, as on a machine with no screen.
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield chromium
        chromium.close()


def _new_page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(60_000)  # as expect's, for actions (clicks, navigation)
    # A fresh instance greets its first visitor with a "Join the Dagster community" dialog over the page.
    page.add_locator_handler(page.get_by_role("button", name="Skip"), lambda skip: skip.click())
    return context, page


@pytest.fixture
def page(browser):
    context, page = _new_page(browser)
    yield page
    context.close()


def _screenshot(page: Page, directory: Path, name: str, element=None) -> Path:
    """The page (or one element of it) as PNG under the test's directory, and $MARL_UI_SCREENSHOTS when set."""
    target = element if element is not None else page
    options = {} if element is not None else {"full_page": True}
    path = directory / f"{name}.png"
    target.screenshot(path=path, **options)
    if extra := os.environ.get("MARL_UI_SCREENSHOTS"):
        Path(extra).mkdir(parents=True, exist_ok=True)
        target.screenshot(path=Path(extra) / f"{name}.png", **options)
    return path


@pytest.fixture(scope="module")
def launched(dagster_ui, browser, demo_config_data):
    """The `train` job launched from the Launchpad with a 2-step config, waited on until it ends."""
    work = dagster_ui["work"]
    # Each agent in one process, as configs/demo.yaml has them: one import of torch, transformers and vLLM an agent.
    data = small_config_data(hybrid_agents(demo_config_data), work / "store", steps=STEPS + 3)
    data["run"] = RUN
    data["evaluation"] = {"every": 1, "cases_per_agent": 8}  # so the run's page has the held-out plot too
    config_path = work / "small.yaml"
    config_path.write_text(yaml.safe_dump(data))
    # What a user types: the experiment file, an override (the Launchpad type-checks it), Ray's CPU count.
    run_config = yaml.safe_dump({"resources": {
        "experiment": {"config": {"config_path": str(config_path), "overrides": {"pipeline": {"steps": STEPS}}}},
        "ray": {"config": {"ray_init_options": {"include_dashboard": False, "num_cpus": 2}}},
    }}, sort_keys=False)

    context, page = _new_page(browser)
    url = dagster_ui["url"]
    page.goto(f"{url}/locations/{LOCATION}/jobs/train/playground")
    editor = page.locator(".CodeMirror")
    # The Launchpad fills its editor with the scaffolded defaults once the job's schema has loaded: replace them.
    expect(editor).to_contain_text("ray_init_options")
    _replace_editor_text(page, run_config)
    expect(page.get_by_text("No errors")).to_be_visible()  # the Launchpad validated it against the job's schema
    _screenshot(page, work, "launchpad")
    page.get_by_role("button", name="Launch Run").click()
    page.wait_for_url("**/runs/*")
    run_url = page.url
    run_id = run_url.rstrip("/").split("/")[-1]
    # The run's page redraws its live logs and Gantt chart for as long as the run goes on, and the launch shares the
    # cores with it: the browser waits on a blank page, and comes back to the run's once it has ended.
    page.goto("about:blank")
    status = _wait_for_run(url, run_id, dagster_ui["log"])
    page.goto(run_url)
    yield {"url": url, "work": work, "run_id": run_id, "status": status, "page": page}
    context.close()


def _replace_editor_text(page, text: str, attempts: int = 3) -> None:
    """Select all in the Launchpad's editor and paste ``text`` (one input event, no auto-indent per typed newline).
    Retried: once, in a fresh-clone run, the editor held '' after the paste (the keystrokes went in before the editor
    had focus), and that is the browser's timing, not the Launchpad's behaviour under test."""
    value = "document.querySelector('.CodeMirror').CodeMirror.getValue()"
    for _ in range(attempts):
        page.locator(".CodeMirror-code").click()
        page.keyboard.press("Control+A")
        page.keyboard.press("Delete")
        page.keyboard.insert_text(text)
        if page.evaluate(value) == text:
            return
        page.wait_for_timeout(1000)
    assert page.evaluate(value) == text


def _wait_for_run(url: str, run_id: str, log: Path) -> str:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        status = _graphql(url, f'{{ runOrError(runId: "{run_id}") {{ ... on Run {{ status }} }} }}')[
            "runOrError"]["status"]
        if status in ("SUCCESS", "FAILURE", "CANCELED"):
            return status
        time.sleep(5)
    pytest.fail(f"run {run_id} did not end in {RUN_TIMEOUT_S} s:\n{_tail(log)}")


def test_train_launched_from_the_launchpad_succeeds(launched, dagster_ui) -> None:
    page = launched["page"]
    assert launched["status"] == "SUCCESS", _tail(dagster_ui["log"])
    # The run's own page, where the Launchpad took the browser, says so (its status tag and the op's step).
    expect(page.get_by_text("Success", exact=True).first).to_be_visible()
    expect(page.get_by_text("stream_training").first).to_be_visible()
    _screenshot(page, launched["work"], "run")


def _markdown(page: Page, label: str):
    """The rendered Markdown of a metadata entry: Dagster shows one under 1,000 characters in the table, a
    longer one (any plot) behind "[Show Markdown]", in a dialog."""
    row = page.locator("tr", has=page.get_by_text(label, exact=True))
    expect(row).to_have_count(1)
    link = row.get_by_text("[Show Markdown]")
    if not link.count():
        return row
    link.click()
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text(label)
    return dialog


def test_rollouts_partitions_and_one_partitions_metadata(launched, page: Page) -> None:
    assert launched["status"] == "SUCCESS"
    page.goto(f"{launched['url']}/assets/rollouts?view=partitions")
    keys = [stage_partition(RUN, step, micro_batch) for step in range(STEPS) for micro_batch in range(MICRO_BATCHES)]
    for key in keys:  # every planned micro-batch of the run is listed, and only those
        expect(page.get_by_text(key, exact=True).first).to_be_visible()
    expect(page.get_by_text(f"Materialized ({len(keys)})")).to_be_visible()
    expect(page.get_by_text(stage_partition(RUN, STEPS, 0), exact=True)).to_have_count(0)
    page.get_by_text(keys[-1], exact=True).first.click()
    expect(page).to_have_url(f"{launched['url']}/assets/rollouts?view=partitions&partition={keys[-1]}")
    # The partition's latest materialization: the train job's metadata, from the run the Launchpad started.
    expect(page.get_by_text(launched["run_id"][:8], exact=True).first).to_be_visible()
    for label in ("dagster/row_count", "tokens", "policy_version", "stage_latency_s", "sample_turns"):
        expect(page.get_by_text(label, exact=True).first).to_be_visible()
    episodes = _markdown(page, "episodes")
    # The conversation: the run's agents in turn order, sampled from the step's policy version (staleness 0).
    expect(episodes).to_contain_text("episode 0")
    text = episodes.inner_text()
    assert text.index("solver (turn 0, policy v1)") < text.index("verifier (turn 1, policy v1)"), text
    episodes.scroll_into_view_if_needed()  # the metadata table scrolls inside the page: show the conversation
    _screenshot(page, launched["work"], "rollouts-partition")


def test_the_runs_plots_render(launched, page: Page) -> None:
    assert launched["status"] == "SUCCESS"
    page.set_viewport_size({"width": 1400, "height": 2000})  # the dialog of plots, whole on the screenshot
    page.goto(f"{launched['url']}/assets/training_runs?view=partitions")
    page.get_by_text(RUN, exact=True).first.click()
    for label in ("episodes_per_s", "pipeline_efficiency", "busy_fraction/engines", "staleness_histogram"):
        expect(page.get_by_text(label, exact=True).first).to_be_visible()
    plots = _markdown(page, "plots").locator("img")
    expect(plots).to_have_count(4)
    # Each plot decoded and drawn by the browser: its natural size is the PNG's, not a broken image's 0 x 0.
    drawn = plots.evaluate_all("images => images.map(i => [i.alt, i.complete && i.naturalWidth > 300])")
    assert drawn == [["reward per step", True], ["staleness per step", True], ["held-out evaluation", True],
                     ["stage activity", True]], drawn
    _screenshot(page, launched["work"], "ui-run-plots", element=page.get_by_role("dialog"))
