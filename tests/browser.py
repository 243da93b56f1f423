"""A real headless Chromium driven by Selenium, for the console's tests.

Debian's `chromium` and `chromium-driver` (what .ci/run installs); the driver's path is given to
Selenium, so it never tries to download one.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.tools import require_tool

INSTALL_HINT = "apt-get install chromium chromium-driver"
WINDOW_SIZE = (1360, 900)
WAIT_S = 20


@contextmanager
def headless_chromium() -> Iterator[WebDriver]:
    driver_path = require_tool("chromedriver", INSTALL_HINT)
    options = webdriver.ChromeOptions()
    options.binary_location = require_tool("chromium", INSTALL_HINT)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     f"--window-size={WINDOW_SIZE[0]},{WINDOW_SIZE[1]}"):  # fmt: skip
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_until(driver: WebDriver, condition, message: str, timeout_s: float = WAIT_S):
    """`condition(driver)`'s first truthy value; fails with `message` after `timeout_s`.

    An element the page replaced while the condition looked at it (the views redraw every second) means: again.
    """
    wait = WebDriverWait(driver, timeout_s, poll_frequency=0.05, ignored_exceptions=[StaleElementReferenceException])
    return wait.until(condition, message)


def console_errors(driver: WebDriver) -> list[str]:
    """The browser console's errors and warnings since the last call (reading the log empties it)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]


def save_screenshot(driver: WebDriver, directory: Path, name: str) -> Path:
    """A PNG of the whole page (the window grown to the document's height first)."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(WINDOW_SIZE[0], max(WINDOW_SIZE[1], height))
    path = directory / f"{name}.png"
    directory.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(path)), f"no screenshot written to {path}"
    driver.set_window_size(*WINDOW_SIZE)
    return path
