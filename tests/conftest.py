"""Suite-wide fixtures."""

import pytest

from llmtrain.launch.secrets import forget_seen


@pytest.fixture(autouse=True)
def _fresh_secret_memory():
    """Each test starts with no remembered secret values. The CLI remembers every secret value of
    its environment policy for the rest of the process (one command in real use); tests that run
    commands in this process would otherwise mask another test's words: a fuzzed secret ``file``
    turned "not a safetensors file" into "not a safetensors ****" in a later test."""
    forget_seen()
    yield
