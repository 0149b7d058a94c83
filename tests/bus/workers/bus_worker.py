"""A consumer-group worker for the bus kill/resume test (run as a subprocess).

Usage: bus_worker.py BOOTSTRAP PREFIX GROUP OUT_FILE DELAY_S
Consumes ``<prefix>turns`` with :class:`pipeline.bus.ConsumerApp`; for every record appends
``partition offset session_id`` to OUT_FILE (flushed + fsynced) *before* acknowledging it.
"""

import os
import sys
import time

from pipeline.bus import ConsumerApp
from pipeline.config import load_config

bootstrap, prefix, group, out_path, delay = sys.argv[1:6]
config = load_config(None, kafka={"bootstrap_servers": bootstrap}, topics={"prefix": prefix})
out = open(out_path, "a", buffering=1)


def handle(rec):
    time.sleep(float(delay))
    out.write(f"{rec.partition} {rec.offset} {rec.event.session_id}\n")
    out.flush()
    os.fsync(out.fileno())


# small polls: the commit (after each poll's records) moves every 20 records, so a kill lands
# after some commits and before others
app = ConsumerApp(config, group, [config.topics.name("turns")], name="bus-worker", max_poll_records=20)
app.run(handle)
