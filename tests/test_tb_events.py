"""TensorBoard event files against tensorboardX's own protocol buffers and
CRC (the reference decoder): every record's checksums hold and every event
decodes to what was written, the purge marker included."""

import glob
import math
import os
import struct

import numpy as np
from tensorboardX import crc32c as reference_crc
from tensorboardX.proto import event_pb2

from mopd_jax import tb_events
from mopd_jax.metrics import MetricWriter


def _records(path):
  """The data of every TFRecord of ``path``, both checksums checked with
  tensorboardX's CRC-32C."""
  def masked(data):
    crc = reference_crc.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

  raw = open(path, "rb").read()
  out, at = [], 0
  while at < len(raw):
    header = raw[at:at + 8]
    (length,) = struct.unpack("<Q", header)
    assert struct.unpack("<I", raw[at + 8:at + 12])[0] == masked(header)
    data = raw[at + 12:at + 12 + length]
    assert struct.unpack("<I", raw[at + 12 + length:at + 16 + length])[0] == (
        masked(data))
    out.append(event_pb2.Event.FromString(data))
    at += 16 + length
  return out


def test_crc32c_matches_the_standard_and_tensorboardx():
  assert tb_events.crc32c(b"123456789") == 0xE3069283  # the check value
  rng = np.random.default_rng(0)
  for n in (0, 1, 7, 300):
    data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    assert tb_events.crc32c(data) == reference_crc.crc32c(data)


def test_metric_writer_events_decode_as_written(tmp_path):
  writer = MetricWriter(str(tmp_path), purge_step=40)
  writer.write(40, {"loss": 0.25, "eval/add/accuracy": 1 / 3})
  writer.write(2**40, {"loss": float("nan"), "lr": -1e-6})
  writer.close()
  (path,) = glob.glob(os.path.join(tmp_path, "tb", "events.out.tfevents.*"))
  first, purge, *scalars = _records(path)
  assert first.file_version == "brain.Event:2"
  assert purge.step == 40 and purge.session_log.status == (
      event_pb2.SessionLog.START)
  assert [e.step for e in scalars] == [40, 2**40]
  values = [{v.tag: v.simple_value for v in e.summary.value}
            for e in scalars]
  assert values[0] == {"loss": 0.25,
                       "eval/add/accuracy": np.float32(1 / 3)}
  assert math.isnan(values[1]["loss"])
  assert values[1]["lr"] == np.float32(-1e-6)
  assert all(e.wall_time > 1.7e9 for e in [first, purge, *scalars])


def test_without_purge_step_no_session_log(tmp_path):
  """And the edges: a negative step (int64 two's complement), a value
  beyond float32 (inf, as tensorboardX writes it), a second writer of the
  same process in the same second (a file of its own)."""
  writer = tb_events.EventFileWriter(str(tmp_path))
  writer.write(-3, {"x": 1.0, "big": -1e39})
  writer.close()
  tb_events.EventFileWriter(str(tmp_path)).close()
  first, second = sorted(glob.glob(os.path.join(tmp_path, "events.*")),
                         key=os.path.getsize, reverse=True)
  events = _records(first)
  assert [e.WhichOneof("what") for e in events] == ["file_version", "summary"]
  assert events[1].step == -3
  assert {v.tag: v.simple_value for v in events[1].summary.value} == {
      "x": 1.0, "big": -math.inf}
  assert len(_records(second)) == 1
