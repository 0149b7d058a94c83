"""Successes at the wrong thing (pipeline.judge.cpu.context.wrong_action), on requests and calls written
for this test: each kind fires on its fault and stays silent on the matching correct call."""

from __future__ import annotations

import json

import pytest

from pipeline.judge.cpu.context import (misspelt_target, narrower_scope, public_instead_of_private, reversed_direction,
                                        target_mismatch, wrong_action, wrong_conversion_target, wrong_count)


def call(name: str, **args) -> str:
    """An assistant output with one rendered tool call, as the judge sees it."""
    return f"[tool calls]\n{name}({json.dumps(args)})"


@pytest.mark.parametrize("check,request_,bad,good", [
    (misspelt_target, "Remove the ./output directory", call("shell", cmd="rm -rf ./outptu"),
     call("shell", cmd="rm -rf ./output")),
    (misspelt_target, "Show the last lines of /var/log/postgres.log", call("sh", cmd="tail /var/log/postrges.log"),
     call("sh", cmd="tail /var/log/postgres.log")),
    (reversed_direction, "Convert 50 pounds to yen", call("fx", **{"from": "JPY", "to": "GBP", "amount": 50}),
     call("fx", **{"from": "GBP", "to": "JPY", "amount": 50})),
    (reversed_direction, "Rename old.txt to new.txt", call("shell", cmd="mv new.txt old.txt"),
     call("shell", cmd="mv old.txt new.txt")),
    (public_instead_of_private, "Send Omar the password privately", call("chat_post", channel="#ops", text="pw"),
     call("chat_dm", user="omar", text="pw")),
    (narrower_scope, "Run the entire test suite please", call("shell", cmd="pytest tests/test_api.py"),
     call("shell", cmd="pytest tests")),
    (narrower_scope, "run all tests", call("shell", cmd="go test ./... -run TestLogin"),
     call("shell", cmd="go test ./...")),
    (wrong_count, "Reserve seats for 3 of us tonight", call("reserve", seats=2), call("reserve", seats=3)),
    # another target language or currency than the request names
    (wrong_conversion_target, "Please translate the menu into German.", call("translate", text="x", target="it"),
     call("translate", text="x", target="de")),
    (wrong_conversion_target, "Convert 45 euros to Japanese yen", call("fx", base="EUR", quote="USD", amount=45),
     call("fx", base="EUR", quote="JPY", amount=45)),
])
def test_each_kind_fires_on_the_fault_only(check, request_, bad, good):
    assert check(request_, bad), (request_, bad)
    assert check(request_, good) is None, (request_, good)
    assert wrong_action(request_, bad) and wrong_action(request_, good) is None


@pytest.mark.parametrize("request_,response", [
    ("List the files", call("shell", cmd="ls -la")),  # nothing named: nothing to compare
    ("Convert this to JSON", call("convert", format="json")),
    ("Book a table", call("book", people=2)),  # the request states no number
    ("Deploy to staging", ""),  # no call
    ("Run the tests for the parser", call("shell", cmd="pytest tests/test_parser.py")),  # a subset was asked
    ("Translate 'hola' for me", call("translate", text="hola", target="en")),  # no target language named
    ("Send the invoice to Maria in accounting", call("email", to="maria@example.com")),  # "to" a person
    ("Book a room for next Tuesday", call("book", start="2025-07-08T10:00")),  # no calendar day named
    ("Book it for 3 July or 4 July, whichever is free", call("book", start="2025-07-04")),
    # correct conversions whose request also names other languages or currencies
    ("Translate my CV into English. I wrote it in German.", call("translate", text="x", target="en")),
    ("I have a paragraph in English, translate it to Spanish", call("translate", text="x", target="es")),
    ("Convert my salary in GBP to USD", call("fx", **{"from": "GBP", "to": "USD", "amount": 1})),
    ("I'm paid in euros. What is 3000 EUR in dollars?", call("fx", **{"from": "EUR", "to": "USD", "amount": 3000})),
    ("30 degrees in Celsius, what is that in Fahrenheit?", call("units", value=30, **{"from": "c", "to": "f"})),
    ("Convert 100 USD to EUR using the rate in real time", call("fx", **{"from": "USD", "to": "EUR", "amount": 100})),
    ("Book the dentist for Thursday 3 July at 9am", call("book", start="2025-07-04T09:00")),  # dates are not read
])
def test_silent_without_evidence(request_, response):
    assert wrong_action(request_, response) is None


@pytest.mark.parametrize("request_,bad,good,kind", [
    ("Send the minutes to marta@acme.io", call("email", to="martin@acme.io"), call("email", to="marta@acme.io"),
     "email"),
    ("Delete old.log please", call("shell", cmd="rm new.log"), call("shell", cmd="rm old.log"), "file"),
    ("Check out feature/search-v2 please", call("shell", cmd="git checkout feature/search"),
     call("shell", cmd="git checkout feature/search-v2"), "branch"),
    # a branch named at the end of a sentence: the full stop is not part of its name
    ("Switch to release/3.1.", call("shell", cmd="git switch release/3.0"),
     call("shell", cmd="git switch release/3.1"), "branch"),
    ("Deploy the fix to staging", call("deploy", env="production"), call("deploy", env="staging"), "env"),
])
def test_a_call_on_another_named_target(request_, bad, good, kind):
    why = target_mismatch(request_, bad)
    assert why and why.split(":", 1)[0] == kind, why
    assert target_mismatch(request_, good) is None


@pytest.mark.parametrize("request_,response", [
    ("Push my commits", call("shell", cmd="git push origin main")),  # no branch named: nothing to compare
    ("Push feature/a to the remote", call("shell", cmd="git push")),  # no branch in the call
    ("Back up report.docx", call("shell", cmd="cp report.docx report.docx.bak")),  # an extra file, none missing
])
def test_no_mismatch_without_evidence(request_, response):
    assert target_mismatch(request_, response) is None
