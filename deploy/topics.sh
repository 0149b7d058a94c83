#!/bin/sh
# Generated from topics.yaml by `pipeline topics render --format kafka-cli`.
set -eu
BS="${BOOTSTRAP:-kafka:9092}"
KT="${KAFKA_TOPICS:-/opt/kafka/bin/kafka-topics.sh}"
"$KT" --bootstrap-server "$BS" --create --if-not-exists --topic turns --partitions 4 --replication-factor 1 --config cleanup.policy=delete --config retention.ms=2592000000 --config max.message.bytes=67108864
"$KT" --bootstrap-server "$BS" --create --if-not-exists --topic samples --partitions 4 --replication-factor 1 --config cleanup.policy=delete --config retention.ms=604800000 --config max.message.bytes=67108864
"$KT" --bootstrap-server "$BS" --create --if-not-exists --topic control --partitions 1 --replication-factor 1 --config cleanup.policy=delete --config retention.ms=604800000
"$KT" --bootstrap-server "$BS" --create --if-not-exists --topic metrics --partitions 1 --replication-factor 1 --config cleanup.policy=delete --config retention.ms=2592000000 --config max.message.bytes=67108864
"$KT" --bootstrap-server "$BS" --create --if-not-exists --topic turns.dlq --partitions 1 --replication-factor 1 --config cleanup.policy=delete --config retention.ms=2592000000
"$KT" --bootstrap-server "$BS" --create --if-not-exists --topic samples.dlq --partitions 1 --replication-factor 1 --config cleanup.policy=delete --config retention.ms=2592000000
"$KT" --bootstrap-server "$BS" --create --if-not-exists --topic control.dlq --partitions 1 --replication-factor 1 --config cleanup.policy=delete --config retention.ms=2592000000
"$KT" --bootstrap-server "$BS" --create --if-not-exists --topic metrics.dlq --partitions 1 --replication-factor 1 --config cleanup.policy=delete --config retention.ms=2592000000
