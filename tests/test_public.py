"""The public names of ``rlfunc`` (re-exported, rlax-style) are the functions of their modules."""

import importlib
import subprocess
import sys

import pytest

import rlfunc


def test_every_public_name_is_its_modules_object():
    for name, module in rlfunc._PUBLIC.items():
        assert getattr(rlfunc, name) is getattr(importlib.import_module(module), name), name
    assert set(rlfunc.__all__) == {"__version__", *rlfunc._PUBLIC}
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        rlfunc.nope  # noqa: B018


def test_import_rlfunc_imports_no_torch():
    # the re-exports are resolved on first use: `import rlfunc` (the CLI's first step) stays cheap
    code = "import sys, rlfunc; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_issue_17_building_blocks_are_public():
    names = ("soft_q_target", "sac_critic_loss", "sac_actor_loss", "temperature_loss", "ensemble_min",
             "smoothed_target_action", "td3_actor_loss", "gmm_entropy", "fit_gmm", "categorical_log_prob",
             "categorical_entropy", "categorical_sample", "categorical_mode", "masked_logits")
    assert set(names) <= set(rlfunc.__all__)
