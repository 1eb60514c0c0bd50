"""TensorBoard event files of scalars, written directly.

An event file is a sequence of TFRecords, each ``uint64 length``,
``uint32 masked_crc32c(length)``, ``data``, ``uint32 masked_crc32c(data)``
(little-endian), whose ``data`` is a serialised ``Event`` protocol buffer.
The few fields written here are encoded by hand (field numbers from
TensorBoard's ``event.proto`` and ``summary.proto``), which spares every
run the import of a writer library (tensorboardX pulls in torch when it is
installed: a second of start-up for each process).
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time

_CRC32C_POLY = 0x82F63B78  # Castagnoli, bit-reversed
_FILES = itertools.count()  # this process's event files


def _crc_table() -> list[int]:
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):
      crc = (crc >> 1) ^ (_CRC32C_POLY if crc & 1 else 0)
    table.append(crc)
  return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli) of ``data``, table-driven, one byte at a time."""
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  """TFRecord's masked CRC: ``rotate_right(crc, 15) + 0xa282ead8``."""
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
  """One TFRecord holding ``data``."""
  length = struct.pack("<Q", len(data))
  return (length + struct.pack("<I", masked_crc32c(length)) + data
          + struct.pack("<I", masked_crc32c(data)))


def _varint(n: int) -> bytes:
  """Base-128 varint; a negative int64 as its two's complement."""
  n &= (1 << 64) - 1
  out = bytearray()
  while True:
    low, n = n & 0x7F, n >> 7
    out.append(low | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
  """A length-delimited field (wire type 2)."""
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(step: int, *, wall_time: float, file_version: str = "",
          scalars: dict[str, float] | None = None,
          session_start: bool = False) -> bytes:
  """A serialised ``Event``: ``wall_time`` (1, double), ``step`` (2),
  and one of ``file_version`` (3), ``summary`` (5: ``Summary.value`` (1)
  of ``Value{tag (1), simple_value (2, float)}``) or ``session_log`` (7:
  ``SessionLog{status (1) = START}``)."""
  out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
  if file_version:
    out += _field(3, file_version.encode())
  if scalars:
    out += _field(5, b"".join(
        _field(1, _field(1, tag.encode()) + b"\x15"
               + struct.pack("<f", _float32(value)))
        for tag, value in scalars.items()))
  if session_start:
    out += _field(7, b"\x08\x01")
  return out


_FLOAT32_MAX = 3.4028234663852886e38


def _float32(value: float) -> float:
  """``value``, or +-inf beyond float32's range (``struct`` refuses it)."""
  return math.copysign(math.inf, value) if (
      math.isfinite(value) and abs(value) > _FLOAT32_MAX) else value


class EventFileWriter:
  """Appends scalar events to a new ``events.out.tfevents.*`` file in
  ``logdir``, flushed at every ``write``. With ``purge_step``, a session
  start at that step tells TensorBoard to discard the events of steps
  ``>= purge_step`` that an earlier, killed run wrote."""

  def __init__(self, logdir: str, purge_step: int | None = None):
    os.makedirs(logdir, exist_ok=True)
    now = time.time()
    name = (f"events.out.tfevents.{int(now)}.{socket.gethostname()}"
            f".{os.getpid()}.{next(_FILES)}")
    self._file = open(os.path.join(logdir, name), "ab")
    self._file.write(record(event(purge_step or 0, wall_time=now,
                                  file_version="brain.Event:2")))
    if purge_step is not None:
      self._file.write(record(event(purge_step, wall_time=now,
                                    session_start=True)))
    self._file.flush()

  def write(self, step: int, scalars: dict[str, float]) -> None:
    self._file.write(record(event(step, wall_time=time.time(),
                                  scalars=scalars)))
    self._file.flush()

  def close(self) -> None:
    self._file.close()
