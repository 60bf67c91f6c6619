"""Ray Serve LLM's per-node download step: skipped for offloaded models only where it is a
no-op (no mirror), kept where it downloads, and a user's own callback is left as written."""

from __future__ import annotations

import asyncio

from ray.serve.llm import LLMConfig

from ray_ple.serve.builder import offload_llm_config
from ray_ple.serve.node_init import CALLBACK_CLS, LocalModelNodeInit
from tests.serving import load_config


def _entry() -> dict:
    return load_config()["applications"][0]["args"]["llm_configs"][0]


def _runs_init_node(source: str) -> bool:
    llm = LLMConfig.model_validate({"model_loading_config": {"model_id": "m",
                                                             "model_source": source},
                                    "accelerator_config": {"kind": "cpu"}})
    callback = LocalModelNodeInit(llm_config=llm)
    asyncio.run(callback.on_before_node_init())
    return callback.ctx.run_init_node


def test_offloaded_models_get_the_callback_and_plain_or_user_callbacks_are_kept():
    assert offload_llm_config(_entry()).callback_config.callback_class == CALLBACK_CLS
    plain = {**_entry(), "ple": {"enabled": False}}
    assert offload_llm_config(plain).callback_config.callback_class != CALLBACK_CLS
    own = {**_entry(), "callback_config": {"callback_class": "my.module:Init"}}
    assert offload_llm_config(own).callback_config.callback_class == "my.module:Init"


def test_the_download_step_is_skipped_only_without_a_mirror(tmp_path):
    assert _runs_init_node(str(tmp_path)) is False
    assert _runs_init_node("s3://bucket/model") is True
