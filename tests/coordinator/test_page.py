"""The swarm page in a real browser (Chromium from the distribution, headless, driven by selenium),
against real node and coordinator processes: it loads, shows the nodes and the routes of requests,
and keeps updating live: a killed node turns `ejected` on the page without a reload.

The browser may reach 127.0.0.1 only (every other host name fails to resolve), so the page and the
API docs are shown to work with no internet.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from layerswarm.harness.browser import chromium_paths, headless_chromium
from layerswarm.harness.procs import Proc, spawn, stop_all

from ..swarm import address, coordinator_process, start_nodes
from .test_attacks_rogue import rogue_cmd
from .test_kserve import png

pytestmark = pytest.mark.slow

if chromium_paths() is None:
    pytest.skip(
        "Chromium and chromium-driver are not installed (apt-get install chromium chromium-driver; .ci/run does)",
        allow_module_level=True,
    )

from selenium.webdriver.common.by import By  # noqa: E402  (a dev dependency)
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402


def wait_for(check: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"the page did not show {what} within {timeout:.0f} s")


@pytest.fixture(scope="module")
def swarm(family_dirs: list[Path]) -> Iterator[tuple[str, list[Proc]]]:
    nodes = start_nodes([(family_dirs[2], b) for b in range(3)] + [(family_dirs[0], 1)])
    coord = coordinator_process(family_dirs[2], nodes, "--health-interval", "0.2", "--policy", "sequential")
    try:
        yield f"http://127.0.0.1:{coord.ready['port']}", nodes
    finally:
        stop_all([coord, *nodes])


@pytest.fixture(scope="module")
def driver() -> Iterator[WebDriver]:
    chrome = headless_chromium()
    try:
        yield chrome
    finally:
        chrome.quit()


# Read what the page shows in one go: it re-renders every second, so element handles go stale.
READ_PAGE = """
const text = (id) => document.getElementById(id).textContent;
return {
  seq: Number(document.getElementById("updated").dataset.seq),
  ready: text("ready"), depth: text("depth"), accuracy: text("accuracy"), blocks: text("blocks-used"),
  nodes: Object.fromEntries([...document.querySelectorAll("#nodes tbody tr")].map(
    (tr) => [tr.dataset.address, {state: tr.dataset.state, why: tr.querySelector("td.why").textContent}])),
  routes: [...document.querySelectorAll("#routes li[data-seq]")].map(
    (li) => [...li.querySelectorAll(".hop")].map((hop) => [hop.textContent, hop.className])),
  results: [...document.querySelectorAll("#routes li[data-seq] .result")].map((span) => span.textContent),
};
"""


def page(driver: WebDriver) -> dict[str, Any]:
    shown: dict[str, Any] = driver.execute_script(READ_PAGE)
    return shown


def states(driver: WebDriver) -> dict[str, str]:
    return {a: n["state"] for a, n in page(driver)["nodes"].items()}


def test_page_shows_nodes_routes_and_updates_when_a_node_dies(swarm: tuple[str, list[Proc]], driver: WebDriver) -> None:
    base, nodes = swarm
    driver.get(base + "/")
    addresses = {address(n) for n in nodes}
    wait_for(lambda: states(driver) == dict.fromkeys(addresses, "healthy"), "four healthy nodes")
    shown = page(driver)
    assert shown["ready"] == "ready" and shown["depth"] == "3 / 3"

    with httpx.Client(base_url=base, timeout=30) as client:
        for seed in range(3):
            reply = client.post("/v1/classify", files={"file": ("a.png", png(seed))}, data={"label": "a"})
            assert reply.status_code == 200, reply.text
    # The page re-renders once a second: wait for all three (a loaded machine showed two at first).
    wait_for(lambda: len(page(driver)["routes"]) == 3, "the three requests")
    routes = page(driver)["routes"]
    assert [text for text, _ in routes[0]] == ["0", "1", "2"] and "ok" in routes[0][0][1]
    assert "of 3" in page(driver)["accuracy"]  # three labelled requests
    # blocks run per request (three of three each: no early exit on this test model) and the exits
    assert page(driver)["blocks"] == "3.00 of 3 · 0 exited early"
    assert all(" · 3 blocks · " in text for text in page(driver)["results"])

    victim = nodes[3]  # the second node of block 1
    seq_before = page(driver)["seq"]
    victim.signal(signal.SIGKILL)
    wait_for(lambda: states(driver).get(address(victim)) == "ejected", "the killed node as ejected")
    shown = page(driver)
    assert shown["seq"] > seq_before  # the page kept receiving events
    assert [n["state"] for a, n in shown["nodes"].items() if a != address(victim)] == ["healthy"] * 3
    assert shown["nodes"][address(victim)]["why"]  # the reason the coordinator gave (unreachable, ...)


def test_page_opens_after_a_login_when_api_keys_are_on(
    swarm: tuple[str, list[Proc]], driver: WebDriver, family_dirs: list[Path], tmp_path: Path
) -> None:
    """With --api-key-file a browser could not open the page (issue 46): it is sent to the login form, signs
    in with a key, and the page shows the swarm live (its event stream rides the cookie, which no script
    can read)."""
    _, nodes = swarm
    (tmp_path / "api.keys").write_text("browser-key-0123456789\n")
    keyed = ["--health-interval", "0.2", "--api-key-file", str(tmp_path / "api.keys")]
    coord = coordinator_process(family_dirs[2], nodes, *keyed)
    try:
        base = f"http://127.0.0.1:{coord.ready['port']}"
        driver.get(base + "/")
        wait_for(lambda: driver.current_url == base + "/login", "the login form")
        driver.find_element(By.ID, "key").send_keys("browser-key-0123456789")
        driver.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        wait_for(lambda: driver.current_url == base + "/", "the page after the login")
        wait_for(lambda: list(states(driver).values()).count("healthy") >= 3, "the healthy nodes")
        seq = page(driver)["seq"]
        wait_for(lambda: page(driver)["seq"] > seq, "a further event")  # the stream is open, not one snapshot
        assert driver.execute_script("return document.cookie") == ""  # HttpOnly
    finally:
        driver.delete_all_cookies()
        stop_all([coord])


@pytest.fixture(scope="module")
def rogue_swarm(family_dirs: list[Path]) -> Iterator[tuple[str, Proc]]:
    """Honest nodes of a family member and a node of the coordinator's own model that answers zeros
    (preferred in sequential order, so the first request goes to it and its probation check)."""
    nodes = start_nodes([(family_dirs[1], b) for b in range(3)])
    rogue = spawn("rogue-zeros", rogue_cmd(family_dirs[0], 0, "zeros"))
    coord = coordinator_process(family_dirs[0], [*nodes, rogue], "--health-interval", "0.2", "--policy", "sequential")
    try:
        yield f"http://127.0.0.1:{coord.ready['port']}", rogue
    finally:
        stop_all([coord, rogue, *nodes])


def test_page_shows_a_convicted_node_and_how_long_its_address_is_barred(
    rogue_swarm: tuple[str, Proc], driver: WebDriver
) -> None:
    """A conviction outlives the node's restarts (a new boot id is barred for a cool-down): the page
    says so beside the node, or an operator sees only `quarantined` and cannot tell why it stays out."""
    base, rogue = rogue_swarm
    with httpx.Client(base_url=base, timeout=30) as client:
        listed = lambda: [n["state"] for n in client.get("/v1/nodes").json()["nodes"]]  # noqa: E731
        wait_for(lambda: listed() == ["healthy"] * 4, "four healthy nodes")
        reply = client.post("/v1/classify", files={"file": ("a.png", png(0))})
        assert reply.status_code == 200, reply.text
        view = {n["address"]: n for n in client.get("/v1/nodes").json()["nodes"]}[address(rogue)]
        assert view["state"] == "quarantined" and view["convictions"] == 1 and view["barred_until"], view
    driver.get(base + "/")
    shown = wait_for(
        lambda: "convicted 1×" in page(driver)["nodes"].get(address(rogue), {}).get("why", "") and page(driver),
        "the rogue as convicted",
    )
    rogue_row = shown["nodes"][address(rogue)]
    assert rogue_row["state"] == "quarantined" and "barred until" in rogue_row["why"], rogue_row
    assert all("convicted" not in n["why"] for a, n in shown["nodes"].items() if a != address(rogue))


def test_api_docs_render_offline(swarm: tuple[str, list[Proc]], driver: WebDriver) -> None:
    """Swagger UI's scripts come from the coordinator itself: the browser can reach nothing else."""
    base, _ = swarm
    driver.get(base + "/docs")
    operations = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".opblock-summary-path"), "Swagger UI")
    paths = {op.text.replace("\u200b", "") for op in operations}
    assert {"/v1/classify", "/v1/classify/batch", "/v2/models/{model}/infer"} <= paths
