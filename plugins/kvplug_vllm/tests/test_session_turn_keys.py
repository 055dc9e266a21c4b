"""A streaming-input session's later turns key their chunks by their own multimodal items.

vLLM keeps a session as one request: each turn appends its tokens, and its images with
placeholder positions moved after the session's tokens (``_update_request_as_session``), and
is scheduled without a new lookup. kvplug keyed the request once, at its first turn: a later
turn's image chunks were keyed by their placeholder ids alone: a request of those ids
without the image would load them, and one with the image missed them. These tests drive vLLM's own
scheduler (real_scheduler.py) with an encoder budget (the tiny model is text only; the
stand-in model runner computes no encoder outputs) and ask kvplug's engine which identity
the session's chunks were stored under: that of an ordinary request of the same prompt and
image (kvplug_vllm's ``request_info``), and no other.
"""

from __future__ import annotations

from typing import Any

from conftest import tokens
from real_scheduler import EngineLoop, real_scheduler, run_turn, session_turn

from kvplug_vllm.request_state import request_info

A = tokens(61, 100)
B = tokens(62, 200)  # the second turn: an image's 40 placeholder ids at 20-60 of it


def image(name: str, offset: int) -> Any:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=name,
        mm_position=PlaceholderRange(offset=offset, length=40),
        mm_hash=name,
    )


def plain_request(prompt: list[int], features: list[Any]) -> Any:
    """An ordinary request of ``prompt`` with ``features`` (no session): how kvplug keys it."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request("plain", prompt, SamplingParams(max_tokens=1), None, mm_features=features)


def test_a_later_turns_image_keys_the_chunks_it_covers(tiny_model: str) -> None:
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    with real_scheduler(tiny_model, "session-images") as (scheduler, engine):
        # the tiny model has no encoder: give vLLM's scheduler the budget a vision model has
        scheduler.max_num_encoder_input_tokens = 1024
        scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=1024)
        loop = EngineLoop(scheduler, engine)
        scheduler.add_request(session_turn(A))
        run_turn(loop)
        scheduler.add_request(session_turn(B, mm_features=[image("img-2", 20)]))
        run_turn(loop)
        session = scheduler.requests["s"]
        prompt = list(session.prompt_token_ids)
        at = session.mm_features[0].mm_position.offset  # after the first turn's prompt and kept output
        assert len(prompt) == 302 and 64 < at < at + 40 < 256, "the image lies inside the stored chunks"
        side = scheduler.connector._scheduler_side()

        def hit(*features: Any) -> int:
            return engine.lookup(prompt, request=request_info(plain_request(prompt, list(features)), side.config))

        assert hit(image("img-2", at)) == 256, "the session's chunks are not keyed by its image"
        assert hit(image("img-3", at)) == 64, "another image's request shares the chunks after it"
        assert hit() == 64, "a request of the placeholder ids alone shares the image's chunks"
        assert loop.wrong_positions(prompt)[1] == [] and loop.misread == []
