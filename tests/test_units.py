import pytest

from vramcal.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("12GiB", 12 * 2**30), ("12 GiB", 12 * 2**30), ("12G", 12 * 2**30), ("16GB", 16 * 10**9),
    ("512MiB", 512 * 2**20), ("1.5GiB", int(1.5 * 2**30)), ("1073741824", 2**30), ("4kib", 4096),
])
def test_parse_bytes_reads_binary_and_decimal_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-1GiB", "twelve"])
def test_parse_bytes_refuses_nonsense_with_the_units_named(text):
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)


def test_format_bytes_uses_the_largest_unit_and_round_trips():
    assert format_bytes(8858370048) == "8.25 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(-2**20) == "-1.00 MiB"
    assert parse_bytes(format_bytes(3 * 2**30).replace(" ", "")) == 3 * 2**30


def test_format_rate_reads_as_a_plain_number_at_every_size():
    """``forecast: 1.91e+03 samples/s`` read badly: from 100 samples/s up, whole numbers with separators."""
    from vramcal.units import format_rate

    assert [format_rate(x) for x in (8.714, 95.66, 957.2, 2090.4, 1234567.0)] == ["8.71", "95.7", "957", "2,090",
                                                                                  "1,234,567"]
