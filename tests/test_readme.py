"""The README's code example runs and recovers the batch exactly."""

from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_api_example_recovers_the_batch():
    text = README.read_text()
    code = text.split("## The API in ten lines")[1].split("```python")[1].split("```")[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    rec, x = namespace["rec"], namespace["x"]
    assert rec.verified
    from tests.conftest import assert_exact

    assert_exact(rec.inputs, x)
    assert isinstance(rec.inputs, torch.Tensor)
