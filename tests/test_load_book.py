"""A caller's ``LoadBook``: which tokens in a replica's load report belong to other callers.

Replicas report per channel; Serve polls those reports about once a second, so a report can still
carry a sequence this process placed and has seen finish. Counting it as another caller's load
would send the next sequence away from an idle replica (as it did to prefix affinity and to idle
replicas taking turns).
"""

from __future__ import annotations

from meshserve.actors.messages import direct_channel
from meshserve.deploy import load
from meshserve.deploy.load import LoadBook


def test_own_channels_are_not_counted_as_other_callers_load() -> None:
    book = LoadBook()
    book.hold("mine", "replica-a", 100)
    # Every client of this process streams on a channel of its own.
    report = {book.new_channel(): 40, book.new_channel(): 30, direct_channel("mine"): 100,
              "other-caller": 7, direct_channel("theirs"): 5}
    assert book.owed("replica-a") == 100
    assert book.others(report) == 12


def test_a_finished_sequence_in_a_stale_report_is_not_counted(monkeypatch) -> None:
    book = LoadBook()
    book.hold("done", "replica-a", 100)
    book.release("done")
    stale = {direct_channel("done"): 100, "other-caller": 3}
    assert book.owed("replica-a") == 0
    assert book.others(stale) == 3

    # Past the report lag, a channel of that name is someone else's again.
    monkeypatch.setattr(load, "REPORT_LAG_S", 0.0)
    book = LoadBook()
    book.hold("later", "replica-b", 10)
    book.release("later")
    assert book.others({direct_channel("later"): 10}) == 10
