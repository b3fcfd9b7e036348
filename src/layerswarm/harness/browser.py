"""A headless Chromium (the distribution's `chromium` and `chromium-driver`) driven by selenium, for
the swarm page test and its README screenshot. It may reach 127.0.0.1 only: every other host name
fails to resolve, so a page that needed a CDN would visibly break."""

from __future__ import annotations

import shutil
from typing import Any


def chromium_paths() -> tuple[str, str] | None:
    """(browser, driver) when both are installed, else None."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def headless_chromium(width: int = 1280, height: int = 1000) -> Any:
    """A selenium WebDriver (selenium is a dev dependency: imported only here)."""
    # selenium is a dev dependency (the page test, the screenshot script): not needed to import this module
    from selenium import webdriver  # noqa: PLC0415
    from selenium.webdriver.chrome.service import Service  # noqa: PLC0415

    paths = chromium_paths()
    if paths is None:
        raise RuntimeError("chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for flag in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={width},{height}",
        "--no-first-run",
        "--disable-background-networking",
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",  # no internet: loopback only
    ):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(executable_path=paths[1]))
