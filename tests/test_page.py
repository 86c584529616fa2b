"""The server's page in a real headless browser (the distribution's Chromium, driven by Selenium):
it loads, a prompt streams, every token carries its source's class, and it works behind an API key.
Each test saves a screenshot beside its output (the path is printed)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from serving import running

from lookahead import LookaheadEngine
from lookahead.drafting.ngrams import SOURCE_NAMES
from lookahead.server import ServerSettings, create_app

pytestmark = pytest.mark.slow
webdriver = pytest.importorskip("selenium.webdriver", reason="the browser test needs the extra `dev` (selenium)")

MODEL = "smollm2-135m"
TOKENS = 64
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no chromium and chromedriver on PATH: `make test` installs them (Debian packages)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def engine(default_model):
    return LookaheadEngine(*default_model)


def ask(browser, url: str, key: str = "") -> str:
    """Load the page, send its prompt (with `key` if given) and wait for the end; the final status."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url + "/")
    assert browser.find_element(By.ID, "model").text == MODEL
    tokens = browser.find_element(By.ID, "tokens")
    tokens.clear()
    tokens.send_keys(str(TOKENS))
    browser.find_element(By.ID, "key").send_keys(key)
    browser.find_element(By.ID, "go").click()
    stats = browser.find_element(By.ID, "stats")
    WebDriverWait(browser, 180).until(lambda _: stats.get_attribute("data-done") in ("yes", "error"))
    return stats.get_attribute("data-done")


def screenshot(browser, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    browser.save_screenshot(str(path))
    print(f"screenshot: {path}")


def test_a_prompt_streams_with_every_token_in_its_sources_colour(browser, engine, tmp_path):
    from selenium.webdriver.common.by import By

    with running(create_app(engine, ServerSettings(MODEL))) as url:
        prompt = None
        for _ in range(2):  # the second time, the answer is in the trie: most tokens come from earlier answers
            assert ask(browser, url) == "yes", browser.find_element(By.ID, "error").text
            prompt = browser.find_element(By.ID, "prompt").get_attribute("value")
    screenshot(browser, tmp_path, "page")
    spans = browser.find_elements(By.CSS_SELECTOR, "#answer span")
    classes = {span.get_attribute("class") for span in spans}
    assert classes <= {f"src-{name}" for name in SOURCE_NAMES}
    assert "src-model" in classes and classes - {"src-model"}, f"drafted tokens were shown: {classes}"
    want = engine.generate(engine.chat_ids([{"role": "user", "content": prompt}]), TOKENS)
    assert "".join(span.get_attribute("textContent") for span in spans) == want.text
    stats = browser.find_element(By.ID, "stats").text
    assert stats.startswith(f"{len(want.token_ids)} tokens") and "tokens per step" in stats


def test_the_page_sends_its_key_to_a_server_that_needs_one(browser, engine, tmp_path):
    from selenium.webdriver.common.by import By

    with running(create_app(engine, ServerSettings(MODEL, api_key="sesame"))) as url:
        assert ask(browser, url) == "error"
        assert browser.find_element(By.ID, "error").text.startswith("401")
        assert ask(browser, url, key="sesame") == "yes", browser.find_element(By.ID, "error").text
    screenshot(browser, tmp_path, "page-with-key")
    assert browser.find_elements(By.CSS_SELECTOR, "#answer span")
