"""TensorBoard event files read as TensorBoard's format defines them (records, CRCs, scalars)."""

from __future__ import annotations

import pathlib
import struct

import pytest

event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")  # tensorboardX is in the test extra


def _crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), bit by bit, as the TFRecord format specifies it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def read_scalars(logdir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``logdir``: tag -> [(step, value)], each record's CRCs checked."""
    found: dict[str, list[tuple[int, float]]] = {}
    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert files, f"no event file in {logdir}"
    for path in files:
        data, at = path.read_bytes(), 0
        while at < len(data):
            header = data[at:at + 8]
            (length,), (length_crc,) = struct.unpack("<Q", header), struct.unpack("<I", data[at + 8:at + 12])
            assert _masked(_crc32c(header)) == length_crc
            record = data[at + 12:at + 12 + length]
            (record_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
            assert _masked(_crc32c(record)) == record_crc
            at += 16 + length
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found
