"""`posttrain data clean`: every rule drops the hand-labelled records it should, with the
reason and counts asserted; text is normalised; per-source rules; worker-count independence;
the CLI."""

import collections
import json

import pytest

from posttrain.cli.data_clean import main
from posttrain.curate._clean import CleanConfig, clean, clean_record, language
from posttrain.errors import UserError


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text, calls=None):
    message = {"role": "assistant", "content": text}
    return {**message, "tool_calls": calls} if calls is not None else message


def _chat(*messages):
    return {"messages": list(messages)}


def _call(name="get_weather", arguments='{"city": "Paris"}'):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


HELLO = [_user("What is two plus two?"), _assistant("Two plus two is four.")]
TOOL_RESULT = {"role": "tool", "content": '{"temperature": 21}'}

# (record, or a raw line that is not a JSON object; the reason it is dropped, None if kept).
# The bounds of FIXTURE_CONFIG: 10 to 300 characters, at most 4 user + assistant turns.
FIXTURE = [
    (_chat(*HELLO), None),
    ({"text": "The quick brown fox jumps over the lazy dog."}, None),
    ({"prompt": "Name a colour.", "completion": "Blue is a colour."}, None),
    (
        _chat(
            {"role": "system", "content": "You can call tools."},
            _user("How warm is it in Paris?"),
            _assistant("", [_call()]),
            TOOL_RESULT,
            _assistant("It is 21 degrees in Paris."),
        ),
        None,
    ),
    # the empty system message goes (a modification); the rest is kept
    (_chat({"role": "system", "content": "  "}, *HELLO), None),
    ({"prompt": [_user("Say hi.")], "completion": [_assistant("Hi there, friend!")]}, None),
    ("{not json", "invalid_json"),
    ("[1, 2, 3]", "invalid_json"),
    ({"question": "Where is the text?"}, "unknown_format"),
    ({"messages": "What is two plus two?"}, "malformed"),
    (_chat({"role": "user"}, _assistant("Four.")), "malformed"),
    ({"text": 42}, "malformed"),
    ({"prompt": "Name a colour.", "completion": [_assistant("Blue.")]}, "malformed"),
    ({"text": " \n\t "}, "empty"),
    (_chat(_user("What is two plus two?"), _assistant("   ")), "empty"),
    ({"prompt": "Name a colour.", "completion": ""}, "empty"),
    (_chat({"role": "narrator", "content": "Once upon a time."}, *HELLO), "bad_role"),
    (_chat(HELLO[0], {"role": "system", "content": "Be brief."}, HELLO[1]), "system_not_first"),
    (_chat(_user("Weather?"), _assistant("", [_call(arguments="{city: Paris")])), "bad_tool_call"),
    (_chat(_user("Weather?"), _assistant("", [_call(arguments="[1, 2]")])), "bad_tool_call"),
    (_chat(_user("Weather?"), _assistant("", [_call(name="")]), TOOL_RESULT), "bad_tool_call"),
    (
        _chat(_user("Weather in Paris?"), TOOL_RESULT, _assistant("It is 21.")),
        "orphan_tool_message",
    ),
    (
        _chat(
            _user("Weather?"),
            _assistant("", [_call()]),
            TOOL_RESULT,
            TOOL_RESULT,
            _assistant("It is 21 degrees."),
        ),
        "orphan_tool_message",
    ),
    (
        _chat(_user("Hello there."), _user("Anyone?"), _assistant("Yes, me.")),
        "roles_not_alternating",
    ),
    (_chat(_assistant("Hello, how can I help?"), *HELLO), "roles_not_alternating"),
    (_chat(*HELLO, *HELLO, *HELLO), "too_many_turns"),
    (_chat(_user("Hi"), _assistant("Yo")), "too_short"),
    ({"text": "word " * 80}, "too_long"),
]
FIXTURE_CONFIG = CleanConfig(min_chars=10, max_chars=300, max_turns=4)


def _write(path, items):
    lines = [item if isinstance(item, str) else json.dumps(item) for item in items]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _read(path):
    return [json.loads(line) for line in open(path)]


def test_each_rule_drops_exactly_its_records(tmp_path):
    source = _write(tmp_path / "raw.jsonl", [record for record, _ in FIXTURE])
    out, rejects = tmp_path / "clean.jsonl", tmp_path / "rejects.jsonl"
    stats = clean([source], str(out), FIXTURE_CONFIG, rejects=str(rejects), workers=1)

    expected = collections.Counter(reason for _, reason in FIXTURE if reason)
    assert set(expected) == {
        "invalid_json", "unknown_format", "malformed", "empty", "bad_role", "system_not_first",
        "bad_tool_call", "orphan_tool_message", "roles_not_alternating", "too_many_turns",
        "too_short", "too_long",
    }  # fmt: skip
    assert stats["dropped"] == dict(expected)
    assert stats["read"] == len(FIXTURE) and stats["kept"] == 6
    assert stats["modified"] == {"empty_turns_removed": 1}
    assert stats["sources"][0]["dropped"] == dict(expected)

    # each reject names its record's line and the reason that record was labelled with
    lines = {i + 1: reason for i, (_, reason) in enumerate(FIXTURE) if reason}
    got = {int(r["location"].rsplit(" ", 1)[1]): r["reason"] for r in _read(rejects)}
    assert got == lines
    assert _read(rejects)[0]["raw"] == "{not json"

    kept = _read(out)
    assert kept[:4] == [record for record, reason in FIXTURE[:4]]
    assert kept[4] == _chat(*HELLO)  # the empty system message removed


def test_bounds_on_turns_and_unencodable_text():
    assert clean_record(json.dumps(_chat(*HELLO)), CleanConfig(min_turns=3)).reason == (
        "too_few_turns"
    )
    assert clean_record(json.dumps(_chat(*HELLO, *HELLO)), CleanConfig(min_turns=3)).reason is None
    lone = '{"text": "half a pair \\ud83d here"}'
    assert clean_record(lone, CleanConfig(strip_control=False)).reason == "unencodable"
    assert clean_record(lone, CleanConfig()).record == {"text": "half a pair  here"}


def test_parquet_source_and_the_rejects_of_unencodable_records(tmp_path):
    from posttrain.data._io import RecordWriter

    source = str(tmp_path / "raw.parquet")
    with RecordWriter(source) as writer:
        for text in ("A fine sentence here.", "Caf\u0065\u0301 au lait.", "  "):
            writer.write({"text": text})
    out, rejects = tmp_path / "out.jsonl", tmp_path / "rejects.jsonl"
    stats = clean([source], str(out), rejects=str(rejects), workers=1)
    assert stats["dropped"] == {"empty": 1} and _read(out)[1] == {"text": "Caf\u00e9 au lait."}
    assert _read(rejects) == [
        {"reason": "empty", "detail": "the text is empty", "source": source,
         "location": f"{source} row 2", "record": {"text": "  "}}
    ]  # fmt: skip

    lone = tmp_path / "lone.jsonl"
    lone.write_text('{"text": "half a pair \\ud83d here"}\n')
    config = CleanConfig(strip_control=False)
    stats = clean([str(lone)], str(out), config, rejects=str(rejects), workers=1)
    assert stats["dropped"] == {"unencodable": 1} and out.read_bytes() == b""
    assert _read(rejects)[0]["raw"] == '{"text": "half a pair \\ud83d here"}'


def test_unicode_is_normalised_and_control_characters_stripped():
    decomposed = "Cafe\u0301 cre\u0300me, s\u2019il vous pla\u00eet."
    record = _chat(_user(decomposed), _assistant("ok\x07 then\x00,\r\n\tbye\x1b[0m"))
    cleaned = clean_record(json.dumps(record), CleanConfig())
    user, assistant = cleaned.record["messages"]
    assert user["content"] == "Caf\u00e9 cr\u00e8me, s\u2019il vous pla\u00eet."
    assert assistant["content"] == "ok then,\n\tbye[0m"  # \n and \t kept, \r and ESC gone
    assert cleaned.modified == ("normalized", "control_chars_stripped")
    assert clean_record(json.dumps(record), CleanConfig(normalize=None, strip_control=False)) == (
        (record, None, "", ())
    )
    nfkc = clean_record(json.dumps({"text": "\ufb01ne \u2460"}), CleanConfig(normalize="NFKC"))
    assert nfkc.record == {"text": "fine 1"}


ENGLISH = "The committee will meet next week to discuss the budget and the new school buildings."
FRENCH = (
    "Le comité se réunira la semaine prochaine pour discuter du budget et des nouvelles écoles."
)
GERMAN = (
    "Der Ausschuss trifft sich nächste Woche, um über den Haushalt und die neuen Schulen zu reden."
)


def test_language_filter_keeps_english_and_drops_french_and_german():
    assert [language(t)[0] for t in (ENGLISH, FRENCH, GERMAN)] == ["en", "fr", "de"]
    config = CleanConfig(languages=("en",))
    reasons = [
        clean_record(json.dumps(_chat(_user(text), _assistant(text))), config).reason
        for text in (ENGLISH, FRENCH, GERMAN)
    ]
    assert reasons == [None, "language", "language"]
    # a short English line is English with probability ~0.55: under a 0.9 floor it goes
    short = "Two plus two is four."
    assert language(short)[0] == "en" and language(ENGLISH)[1] > 0.9 > language(short)[1]
    strict = CleanConfig(languages=("en",), min_language_confidence=0.9)
    assert clean_record(json.dumps({"text": ENGLISH}), strict).reason is None
    dropped = clean_record(json.dumps({"text": short}), strict)
    assert dropped.reason == "language" and "probability" in dropped.detail
    with pytest.raises(ValueError, match="py3langid"):
        CleanConfig(languages=("en", "xx"))


def test_per_source_rules_apply_to_their_source_only(tmp_path):
    records = [_chat(*HELLO), {"text": "A longer text that has more than fifty characters in it."}]
    a = _write(tmp_path / "a.jsonl", records)
    b = _write(tmp_path / "b.jsonl", records)
    out = tmp_path / "out.jsonl"
    stats = clean([a, (b, CleanConfig(max_chars=50))], str(out), workers=1)
    assert [s["dropped"] for s in stats["sources"]] == [{}, {"too_long": 1}]
    assert stats["kept"] == 3 and stats["dropped"] == {"too_long": 1}
    assert _read(out) == [*records, records[0]]


def test_output_is_identical_with_one_and_two_workers(tmp_path):
    source = _write(tmp_path / "raw.jsonl", [record for record, _ in FIXTURE] * 3)
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    stats_one = clean([source], str(one), FIXTURE_CONFIG, workers=1, chunk_size=5)
    stats_two = clean([source], str(two), FIXTURE_CONFIG, workers=2, chunk_size=5)
    assert one.read_bytes() == two.read_bytes()
    assert stats_one == stats_two and stats_one["kept"] == 18


def test_cli_writes_output_rejects_and_stats(tmp_path, capsys):
    source = _write(tmp_path / "raw.jsonl", [record for record, _ in FIXTURE])
    out, stats = tmp_path / "clean.arrayrecord", tmp_path / "stats.json"
    overrides = tmp_path / "rules.json"
    overrides.write_text(json.dumps({source: {"max_turns": 4}}))
    flags = ["--min-chars=10", "--max_chars=300", f"--overrides={overrides}", "--workers=1"]
    assert (
        main(
            [
                "posttrain data clean",
                f"--input={source}",
                f"--out={out}",
                *flags,
                f"--stats={stats}",
            ]
        )
        == 0
    )
    counts = json.loads(stats.read_text())
    assert counts["kept"] == 6
    assert counts["dropped"] == dict(collections.Counter(r for _, r in FIXTURE if r))
    assert "wrote 6 of 28 records" in capsys.readouterr().out

    from posttrain.data._io import read_records

    assert [r for r, _ in read_records(str(out))][0] == _chat(*HELLO)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--out={tmp}/o.jsonl"], "--input=PATTERN"),
        (["--input={tmp}/missing.jsonl", "--out={tmp}/o.jsonl"], "does not exist"),
        (["--input={src}", "--out={tmp}/o.txt"], "unsupported suffix"),
        (["--input={src}", "--out={tmp}/o.jsonl", "--max_chars=many"], "max_chars"),
        (["--input={src}", "--out={tmp}/o.jsonl", "--bogus=1"], "bogus"),
        (["--input={src}", "--out={tmp}/o.jsonl", "--normalize=NFX"], "normalize"),
        (["--input={src}", "--out={tmp}/o.jsonl", "--languages=en,xx"], "py3langid"),
        (["--input={src}", "--out={tmp}/o.jsonl", "--overrides={tmp}/rules.json"], "no --input"),
        (["--input={src}", "--out={tmp}/o.jsonl", "--overrides={tmp}/bad.json"], "do not exist"),
    ],
)
def test_cli_user_errors(tmp_path, flags, message):
    src = _write(tmp_path / "raw.jsonl", [_chat(*HELLO)])
    (tmp_path / "rules.json").write_text(json.dumps({"other.jsonl": {"max_chars": 9}}))
    (tmp_path / "bad.json").write_text(json.dumps({src: {"max_char": 9}}))
    argv = [f.format(tmp=tmp_path, src=src) for f in flags]
    with pytest.raises(UserError, match=message):
        main(["posttrain data clean", *argv])
    assert not (tmp_path / "o.jsonl").exists()
