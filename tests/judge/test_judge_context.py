"""Successes at the wrong thing (pipeline.judge.cpu.context.wrong_action), on requests and calls written
for this test: each kind fires on its fault and stays silent on the matching correct call."""

from __future__ import annotations

import json

import pytest

from pipeline.judge.cpu.context import (misspelt_target, narrower_scope, public_instead_of_private, reversed_direction,
                                    other_day, target_mismatch, wrong_action, wrong_conversion_target,
                                    wrong_count)


def call(name: str, **args) -> str:
    """An assistant output with one rendered tool call, as the judge sees it."""
    return f"[tool calls]\n{name}({json.dumps(args)})"


@pytest.mark.parametrize("check,request_,bad,good", [
    (misspelt_target, "Remove the ./output directory", call("shell", cmd="rm -rf ./outptu"),
     call("shell", cmd="rm -rf ./output")),
    (misspelt_target, "Show the last lines of /var/log/postgres.log", call("sh", cmd="tail /var/log/postrges.log"),
     call("sh", cmd="tail /var/log/postgres.log")),
    (reversed_direction, "How much is 50 pounds in yen?", call("fx", **{"from": "JPY", "to": "GBP", "amount": 50}),
     call("fx", **{"from": "GBP", "to": "JPY", "amount": 50})),
    (reversed_direction, "Rename old.txt to new.txt", call("shell", cmd="mv new.txt old.txt"),
     call("shell", cmd="mv old.txt new.txt")),
    (reversed_direction, "Download the report from s3://acme-reports/2026/q3.csv into ./reports.",
     call("shell", cmd="aws s3 cp ./reports/q3.csv s3://acme-reports/2026/q3.csv"),
     call("shell", cmd="aws s3 cp s3://acme-reports/2026/q3.csv ./reports/")),
    (public_instead_of_private, "Send Omar the password privately", call("chat_post", channel="#ops", text="pw"),
     call("chat_dm", user="omar", text="pw")),
    (narrower_scope, "Run the entire test suite please", call("shell", cmd="pytest tests/test_api.py"),
     call("shell", cmd="pytest tests")),
    (narrower_scope, "run all tests", call("shell", cmd="go test ./... -run TestLogin"),
     call("shell", cmd="go test ./...")),
    (wrong_count, "Reserve seats for three of us tonight", call("reserve", seats=2), call("reserve", seats=3)),
    # the day of a date is no count: "June 7" does not make guests=7 a number the request states
    (wrong_count, "A table for 4 on June 7, please", call("book", guests=7), call("book", guests=4)),
    (reversed_direction, "How many dollars is 80 euros?", call("fx", **{"from": "USD", "to": "EUR", "amount": 80}),
     call("fx", **{"from": "EUR", "to": "USD", "amount": 80})),
    (reversed_direction, "how much yen for 20 pounds", call("fx", **{"from": "JPY", "to": "GBP", "amount": 20}),
     call("fx", **{"from": "GBP", "to": "JPY", "amount": 20})),
    # another target language, currency or unit than the request names
    (wrong_conversion_target, "Please translate the menu into German.", call("translate", text="x", target="it"),
     call("translate", text="x", target="de")),
    (wrong_conversion_target, "Übersetze das bitte ins Englische: 'Guten Tag'. Auf Englisch bitte.",
     call("translate", text="Guten Tag", source="de", target="fr"), call("translate", text="Guten Tag", target="en-GB")),
    (wrong_conversion_target, "what is 300 swiss francs in british pounds",
     call("fx", **{"from": "CHF", "to": "EUR", "amount": 300}), call("fx", **{"from": "CHF", "to": "GBP", "amount": 300})),
    (wrong_conversion_target, "Convert 45 euros to Japanese yen", call("fx", base="EUR", quote="USD", amount=45),
     call("fx", base="EUR", quote="JPY", amount=45)),
    (wrong_conversion_target, "How far is 10 miles in km?", call("units", value=10, **{"from": "mi", "to": "m"}),
     call("units", value=10, **{"from": "mi", "to": "km"})),
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
    # dates never make a call wrong_action (-1): see other_day
    ("Book the dentist for Thursday 3 July at 9am", call("book", start="2025-07-04T09:00")),
])
def test_silent_without_evidence(request_, response):
    assert wrong_action(request_, response) is None


@pytest.mark.parametrize("request_,bad,good", [
    ("Book the dentist for Thursday 3 July at 9am", call("book", start="2025-07-05T09:00"),
     call("book", start="2025-07-03T09:00")),
    ("schedule the review on March 14th", call("cal_add", date="2026-03-17"), call("cal_add", date="2026-03-14")),
    ("Move the call to 2025-11-02", call("reschedule", when="2025-12-02 10:00"),
     call("reschedule", when="2025-11-02 10:00")),
    # one day off, and not the weekday the request names
    ("Put the dentist in my calendar: Tuesday 9 February, 8:30", call("cal_add", start="2027-02-10T08:30:00"),
     call("cal_add", start="2027-02-09T08:30:00")),
])
def test_another_day_abstains(request_, bad, good):
    assert other_day(request_, bad) and other_day(request_, good) is None
    assert wrong_action(request_, bad) is None  # a date only makes the judge abstain


@pytest.mark.parametrize("request_,response", [
    ("Am I free on June 13?", call("list_events", start="2025-06-01", end="2025-06-30")),  # a range
    ("Call with Tokyo on March 5 at 8am their time", call("book", start="2025-03-04T23:00Z")),  # UTC: a day off
    ("Remind me on June 2 about the June 9 deadline", call("remind", at="2025-06-02T08:00")),  # two days named
    ("New Year call on January 1", call("book", start="2025-12-31T23:30")),  # across the year
    ("Book the dentist Tuesday 9 February 11:30pm PST", call("book", start="2027-02-10T07:30:00Z")),  # UTC
    ("Remind me the day before Tuesday 9 February", call("remind", at="2027-02-08")),  # derived
])
def test_no_other_day_without_evidence(request_, response):
    assert other_day(request_, response) is None




@pytest.mark.parametrize("request_,bad,good,kind", [
    # one of two files swapped for another
    ("Rename notes_old.md to notes.md", call("rename", src="notes_tmp.md", dst="notes.md"),
     call("rename", src="notes_old.md", dst="notes.md"), "file"),
    ("Copy q1.csv to q1_backup.csv", call("shell", cmd="cp q2.csv q1_backup.csv"),
     call("shell", cmd="cp q1.csv q1_backup.csv"), "file"),
    # git on another branch than the one named
    ("Push my work on fix/cart-total to the remote", call("shell", cmd="git push origin main"),
     call("shell", cmd="git push origin fix/cart-total"), "branch"),
    ("Check out feature/search-v2 please", call("shell", cmd="git checkout feature/search"),
     call("shell", cmd="git checkout feature/search-v2"), "branch"),
    ("Merge release/1.4 into main", call("shell", cmd="git merge release/1.3"),
     call("shell", cmd="git merge release/1.4"), "branch"),
    # a branch named at the end of a sentence: the full stop is not part of its name
    ("Switch to release/3.1.", call("shell", cmd="git switch release/3.0"),
     call("shell", cmd="git switch release/3.1"), "branch"),

    # the same name with another number: "Budget 2026" for "Budget 2027", sprint 15 for sprint 14
    ("In the 'Budget 2027' sheet, set B7 to 18,500", call("sheets", range="'Budget 2026'!B7", values=[[18500]]),
     call("sheets", range="'Budget 2027'!B7", values=[[18500]]), "numbered"),
    ("Move the card to sprint 14", call("board", sprint="Sprint 15"), call("board", sprint="sprint 14"), "numbered"),
    # an amount written with a thousands separator is one number; 2300.0 is not 3,200
    ("Send Greyfield their invoice for $3,200", call("send_invoice", customer="Greyfield", amount=2300.0),
     call("send_invoice", customer="Greyfield", amount=3200.0), "number"),
])
def test_a_call_on_another_named_target(request_, bad, good, kind):
    why = target_mismatch(request_, bad)
    assert why and why.split(":", 1)[0] == kind, why
    assert target_mismatch(request_, good) is None


@pytest.mark.parametrize("request_,response", [
    ("Push my commits", call("shell", cmd="git push origin main")),  # no branch named: nothing to compare
    ("Push feature/a to the remote", call("shell", cmd="git push")),  # no branch in the call
    ("Back up report.docx", call("shell", cmd="cp report.docx report.docx.bak")),  # an extra file, none missing
    # dates and times are not counts: "7 December at 3pm" is the ISO start, "7:30pm" is "19:30"
    ("Book a 30 minute sync next Monday 7 December at 3pm", call("cal_add", start="2026-12-07T15:00:00+01:00")),
    ("A table for four on Saturday at 7:30pm", call("reserve", date="2026-12-12", time="19:30", party_size=4)),
    ("Dentist on 14 March 2025 at 9:30", call("cal_add", start="2025-03-14T09:30:00", duration_min=45)),
    # a correct copy whose destination comes first; the day before a named weekday; a time in UTC
    ("Copy q3.csv from downloads/q3.csv into reports/", call("shell", cmd="cp -t reports/ downloads/q3.csv")),
    ("Show page 2 of the results for invoice 7781", call("search", q="invoice 7781", page=2)),  # other names
])
def test_no_mismatch_without_evidence(request_, response):
    assert target_mismatch(request_, response) is None
    assert wrong_action(request_, response) is None


@pytest.mark.parametrize("request_,bad,good", [
    # words that begin like a month are no dates: their numbers are counts
    ("Mark 3 emails as read", call("mark_read", count=5), call("mark_read", count=3)),
    ("Round the totals to 2 decimals", call("fmt", places=3), call("fmt", places=2)),
    ("Install Python 3.10", call("shell", cmd="uv python install 3.1"), call("shell", cmd="uv python install 3.10")),
])
def test_another_number_is_a_mismatch(request_, bad, good):
    why = target_mismatch(request_, bad)
    assert why and why.startswith("number"), why
    assert target_mismatch(request_, good) is None
