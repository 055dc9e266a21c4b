"""Bounded number types for config fields: finite, and within a range that is named.

pydantic's ``PositiveFloat`` takes ``.inf`` (a YAML float) and ``PositiveInt`` takes
``copy_threads: 100000``: values that cannot be right, accepted at start-up and failing
(or hanging) later. A field typed with one of these aliases takes only a finite number
within its bounds, and a value outside them is a config error that names the field, the
value and the bound::

    store.block_timeout_s: Value error, must be a finite number of seconds greater than 0
    and less than or equal to 3600 (one hour) (got inf)

Plugins use them through the public ``kvplug`` namespace (``kvplug.TimeoutSeconds``), or
:class:`Bounded` for a range of their own: ``Annotated[float, Bounded(0, 60, "seconds")]``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import ByteSize, GetCoreSchemaHandler, GetJsonSchemaHandler, TypeAdapter, ValidationError
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

#: The longest timeout, deadline or cooldown any setting may ask for.
MAX_TIMEOUT_S = 3600.0
#: The longest wait between two retries.
MAX_BACKOFF_S = 60.0
#: The most threads one pool of a component may start.
MAX_THREADS = 256
#: The most connections or operations in flight that one component may hold open.
MAX_CONCURRENCY = 1024
#: The most consecutive failures a circuit breaker may wait for before it opens.
MAX_FAILURES = 1000
#: The longest a queue may be, in items (batches, requests); byte bounds are separate settings.
MAX_QUEUE_ITEMS = 65536
#: The largest byte size any setting may name (4 EiB): far above any machine, and small
#: enough that sums of a few budgets still fit a signed 64-bit counter.
MAX_BYTE_SIZE = 2**62


@dataclass(frozen=True)
class Bounded:
    """pydantic metadata: a finite number from ``minimum`` to ``maximum``.

    ``exclusive_minimum``: the number must be greater than ``minimum`` (a timeout of 0
    would time out at once). ``unit`` names what the number counts, for the error and
    the config reference; ``note`` says what the maximum means (``one hour``).
    """

    minimum: float
    maximum: float
    unit: str = ""
    exclusive_minimum: bool = False
    note: str = ""

    def describe(self) -> str:
        """The allowed range, in words: ``greater than 0 and less than or equal to 3600 (one hour)``."""
        # pydantic's words, as in its own range errors ("less than or equal to 1048576").
        low = "greater than" if self.exclusive_minimum else "greater than or equal to"
        note = f" ({self.note})" if self.note else ""
        return f"{low} {_number(self.minimum)} and less than or equal to {_number(self.maximum)}{note}"

    def check(self, value: Any) -> Any:
        """``value`` if it is finite and within the bounds, else ``ValueError`` naming them."""
        unit = f" of {self.unit}" if self.unit else ""
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"must be a finite number{unit} {self.describe()}")
        low_ok = value > self.minimum if self.exclusive_minimum else value >= self.minimum
        if not low_ok or value > self.maximum:
            raise ValueError(f"must be a number{unit} {self.describe()}")
        return value

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        json_schema = handler(schema)
        json_schema["exclusiveMinimum" if self.exclusive_minimum else "minimum"] = self.minimum
        json_schema["maximum"] = self.maximum
        return json_schema


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


#: A timeout, deadline or cooldown in seconds: more than 0, at most an hour.
TimeoutSeconds = Annotated[float, Bounded(0, MAX_TIMEOUT_S, "seconds", exclusive_minimum=True, note="one hour")]
#: A wait between retries in seconds: 0 (retry at once) up to a minute.
BackoffSeconds = Annotated[float, Bounded(0, MAX_BACKOFF_S, "seconds", note="one minute")]
#: Threads of one pool: 1 to 256.
ThreadCount = Annotated[int, Bounded(1, MAX_THREADS, "threads")]
#: Connections or operations in flight at once: 1 to 1024.
Concurrency = Annotated[int, Bounded(1, MAX_CONCURRENCY)]
#: Length of a queue in items: 1 to 65536 (its bytes are bounded by a setting of their own).
QueueItems = Annotated[int, Bounded(1, MAX_QUEUE_ITEMS, "items")]
#: Consecutive failures before a circuit breaker opens: 1 to 1000.
FailureCount = Annotated[int, Bounded(1, MAX_FAILURES, "failures")]


_BYTE_SIZE: TypeAdapter[ByteSize] = TypeAdapter(ByteSize)
#: The whole of a size's text: a number, then at most a unit.
_SIZE_TEXT = re.compile(r"(\d+(\.\d*)?|\.\d+)\s*[A-Za-z]*")


def parse_byte_size(value: Any) -> int:
    """The one rule for byte sizes: a whole number of bytes (``1073741824``, ``"1073741824"``) or a
    number with a unit (``"512MiB"``, ``"1.5GB"``), from 0 to :data:`MAX_BYTE_SIZE`.

    ``ValueError`` says which rule ``value`` breaks: a boolean or float where bytes are meant,
    a negative size, text that is no size, a size over 4 EiB. Settings models apply it to every
    ``ByteSize`` field (:class:`kvplug.core.components.CheckedModel`), so plugins' sizes follow
    it too.
    """
    if isinstance(value, bool):
        raise ValueError(f"must be a byte size, not a boolean ({str(value).lower()})")
    if isinstance(value, float):
        raise ValueError(f"must be a whole number of bytes or a size with a unit (4GiB), not a float ({value!r})")
    if isinstance(value, str) and value.strip().startswith("-"):
        raise ValueError("must not be negative")
    if isinstance(value, str):
        try:
            # pydantic reads a leading size and ignores what follows it ("8GiB of memory")
            if not _SIZE_TEXT.fullmatch(value.strip()):
                raise ValueError(value)
            size = int(_BYTE_SIZE.validate_python(value.strip()))
        except (ValidationError, ValueError):
            raise ValueError(
                f"{value!r} is not a byte size: give a whole number of bytes or a number with a unit "
                "(512MiB, 4GiB, 1TB; units B, KB/KiB, MB/MiB, GB/GiB, TB/TiB, PB/PiB, EB/EiB)"
            ) from None
    elif isinstance(value, int):
        size = value
    else:
        raise ValueError(f"must be a byte size (4GiB or a whole number of bytes), not a {type(value).__name__}")
    if size < 0:
        raise ValueError("must not be negative")
    if size > MAX_BYTE_SIZE:
        raise ValueError(f"must be at most 4 EiB ({MAX_BYTE_SIZE} bytes)")
    return size
