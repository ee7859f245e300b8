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


def test_format_duration_takes_an_intervals_unit_from_its_value():
    """A run forecast of 10.4 min read ``10.4 min (571 s–11.4 min)``: its ends now take the value's unit."""
    from vramcal.units import format_duration

    assert [format_duration(s) for s in (0.84, 130, 571, 710, 35_000)] == ["0.84 s", "130 s", "571 s", "11.8 min",
                                                                          "9.72 h"]
    assert format_duration(571, like=624) == "9.52 min" and format_duration(684, like=624) == "11.4 min"
    assert format_duration(650, like=120) == "650 s"
