"""An SGLang LoRA adapter is keyed by its files, not its path: an RL loop that rewrites its
adapter at the same path and calls ``load_lora_adapter`` again (a new ``LoRARef``, a new
``lora_id``) never loads the old adapter's chunks; the same files at another path share."""

from __future__ import annotations

import shutil
from array import array
from pathlib import Path

from sglang.srt.lora.lora_registry import LoRARef
from sglang.srt.mem_cache.radix_cache import RadixKey

import kvplug
from kvplug.testing import write_lora_adapter
from kvplug_sglang.request_keys import RequestKeys


def identity(ref: LoRARef, keys: RequestKeys | None = None) -> kvplug.RequestInfo:
    """What a request of the adapter ``ref`` (its lora_id in the radix key) is keyed by."""
    keys = keys or RequestKeys(lambda: {ref.lora_id: ref})
    info = keys.for_request(RadixKey(array("i", range(3, 67)), extra_key=ref.lora_id), ref.lora_id)
    assert info is not None and info.lora_id == "sql"
    return info


def test_an_adapter_rewritten_at_its_path_and_reloaded_is_keyed_apart_from_the_old_one(tmp_path: Path) -> None:
    adapter = write_lora_adapter(tmp_path / "sql", b"weights of step 1")
    loaded = LoRARef(lora_name="sql", lora_path=str(adapter))
    server = RequestKeys(lambda: {loaded.lora_id: loaded})
    before = identity(loaded, server)
    assert identity(LoRARef(lora_name="sql", lora_path=str(adapter))).extra_keys == before.extra_keys

    write_lora_adapter(adapter, b"weights of step 2")  # the trainer's next checkpoint, same path
    after = identity(LoRARef(lora_name="sql", lora_path=str(adapter)))  # load_lora_adapter again
    assert after.extra_keys != before.extra_keys, "the rewritten adapter was keyed as the old one: its KV would hit"
    # Until it is reloaded, the old load still runs the old weights: its requests keep its key.
    assert identity(loaded, server).extra_keys == before.extra_keys


def test_the_same_adapter_files_at_another_path_are_keyed_alike(tmp_path: Path) -> None:
    adapter = write_lora_adapter(tmp_path / "server-1" / "sql", b"weights")
    copy = shutil.copytree(adapter, tmp_path / "server-2" / "sql-v7")
    one = identity(LoRARef(lora_name="sql", lora_path=str(adapter)))
    assert identity(LoRARef(lora_name="sql", lora_path=str(copy))).extra_keys == one.extra_keys
