"""Runs notebooks/accept_length.ipynb top to bottom (nbclient) with small parameters.

The notebook measures the default model's MTP accept length and asserts that the checkpoint
strategies (extra_buffer / extra_buffer_lazy, with and without forced spare-allocation
failures) give identical tokens and accept lengths. Skipped only when the embedded default
model folder does not exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "accept_length.ipynb"
MODEL = ROOT / "lazyspec" / "assets" / "default_model"
SMALL = {
    "LAZYSPEC_NB_PROMPTS": "2",
    "LAZYSPEC_NB_PROMPT_TOKENS": "100",
    "LAZYSPEC_NB_NEW_TOKENS": "40",
    "LAZYSPEC_NB_STEPS": "1,3",
    "LAZYSPEC_NB_TEMPERATURES": "0,1.0",
    "LAZYSPEC_NB_BATCHES": "1,2",
}


@pytest.mark.slow
@pytest.mark.skipif(
    not (MODEL / "config.json").is_file(),
    reason="the default model folder lazyspec/assets/default_model is missing",
)
def test_accept_length_notebook_runs(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    for key, value in SMALL.items():
        monkeypatch.setenv(key, value)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    text = "\n".join(
        out.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )
    assert "identical outputs and accept lengths across strategies" in text
    assert "steps=3: accept length" in text and "tokens per verify step" in text
    # the small parameters reached the notebook: its reports list exactly these runs
    assert re.search(r"^2 prompts from ", text, re.M), text[:500]
    runs = re.findall(r"^(steps=\d+|T=[\d.]+|batch \d+):", text, re.M)
    assert runs == ["steps=1", "steps=3", "T=0.0", "T=1.0", "batch 1", "batch 2"], runs
