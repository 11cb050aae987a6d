"""What a process that imports once and then forks builds before it forks (rlctl.engine.warm): a model
loaded after it builds no table again, and the tables are the ones a cold load builds."""

import torch
import transformers.conversion_mapping as cm

from rlctl.config.sections import BuiltinModelConfig
from rlctl.engine import model
from rlctl.engine.rollout import noise
from rlctl.engine.warm import warm_caches


def test_a_model_loaded_after_the_warm_up_builds_no_table_again(tmp_path, monkeypatch):
    spec = BuiltinModelConfig()
    tok = model.build_builtin_tokenizer(spec)
    model.build_tiny_model(spec, tok, 0).save_pretrained(tmp_path, save_original_format=False)
    tok.save_pretrained(tmp_path)
    cold = cm._build_checkpoint_conversion_mapping()
    cold_table = noise.gumbel_table().copy()
    monkeypatch.setattr(cm, "_checkpoint_conversion_mapping_cache", None)  # (as in a process that loaded none)
    noise.gumbel_table.cache_clear()

    warm_caches()

    def built_again():
        raise AssertionError("the renaming table was built again")

    monkeypatch.setattr(cm, "_build_checkpoint_conversion_mapping", built_again)
    model.load_causal_lm(tmp_path, torch.float32)
    assert repr(cm._checkpoint_conversion_mapping_cache) == repr(cold)
    assert noise.gumbel_table.cache_info().currsize == 1
    assert noise.gumbel_table().tobytes() == cold_table.tobytes()
