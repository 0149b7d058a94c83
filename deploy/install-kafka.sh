#!/usr/bin/env bash
# Fetch Apache Kafka's broker jars (pinned version, every jar's sha256 checked against
# deploy/kafka-jars.sha256) from Maven Central with Maven, into a cache outside the checkout:
#   ${PIPELINE_KAFKA_HOME:-~/.cache/openclaw-pipeline/kafka/<version>}/libs/*.jar
# `pipeline broker --kind kafka` (and `pipeline up`, the tests) run the broker from there.
# Idempotent: a complete, checked cache is left as it is. Needs Java >= 17 and Maven (mvn); without
# them it says so and exits 0 (the embedded Tansu broker is used instead), unless --require.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=4.1.1
LOG4J=2.24.3
SUMS="$PWD/deploy/kafka-jars.sha256"
HOME_DIR="${PIPELINE_KAFKA_HOME:-$HOME/.cache/openclaw-pipeline/kafka/$VERSION}"
REQUIRE=0
[ "${1:-}" = "--require" ] && REQUIRE=1

skip() {  # why Apache Kafka is not installed
  echo "note: Apache Kafka not installed ($1): the pipeline uses the embedded Tansu broker" >&2
  [ "$REQUIRE" = 1 ] && exit 1
  exit 0
}

check() {  # every pinned jar present with its sha256, nothing else
  local dir="$1" want have
  want=$(grep -v '^#' "$SUMS" | awk '{print $2}' | sort)
  have=$(cd "$dir" 2>/dev/null && ls -1 *.jar 2>/dev/null | sort) || return 1
  [ "$want" = "$have" ] || return 1
  (cd "$dir" && grep -v '^#' "$SUMS" | sha256sum --quiet -c -) >/dev/null 2>&1
}

if [ -f "$HOME_DIR/installed" ] && check "$HOME_DIR/libs"; then
  echo "Apache Kafka $VERSION already installed in $HOME_DIR ($(du -sh "$HOME_DIR/libs" | cut -f1), checked)"
  exit 0
fi
command -v java >/dev/null 2>&1 || skip "no java on the PATH; it needs Java >= 17"
JAVA_MAJOR=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
[ -n "$JAVA_MAJOR" ] && [ "$JAVA_MAJOR" -ge 17 ] || skip "java is version ${JAVA_MAJOR:-unknown}; it needs >= 17"
command -v mvn >/dev/null 2>&1 || skip "no Maven (mvn) to fetch the jars from Maven Central"

echo "fetching Apache Kafka $VERSION jars from Maven Central (about 45 MB)..."
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cat > "$WORK/pom.xml" <<POM
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>openclaw-pipeline</groupId><artifactId>kafka-broker</artifactId><version>1</version>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>$VERSION</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId><version>$LOG4J</version></dependency>
  </dependencies>
</project>
POM
# progress: a line every 100 files Maven downloads (its plugins too, the first time: ~2.5 min cold)
progress() { { grep --line-buffered '^\[INFO\] Downloaded from' || true; } |
             awk '{n++; if (n % 100 == 0) {printf "  %d files downloaded...\n", n; fflush()}}'; }
if ! (cd "$WORK" && mvn -B dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$WORK/libs" \
        2>&1 | tee "$WORK/mvn.log" | progress; exit "${PIPESTATUS[0]}"); then
  tail -20 "$WORK/mvn.log" >&2
  skip "Maven could not fetch org.apache.kafka:kafka_2.13:$VERSION (see above)"
fi
if ! check "$WORK/libs"; then
  echo "error: the fetched jars do not match deploy/kafka-jars.sha256:" >&2
  (cd "$WORK/libs" && grep -v '^#' "$SUMS" | sha256sum -c - 2>&1 | grep -v ': OK$' | head) >&2 || true
  exit 1
fi
mkdir -p "$HOME_DIR"
rm -rf "$HOME_DIR/libs" "$HOME_DIR/installed" "$HOME_DIR/kafka.jsa" "$HOME_DIR/format-template"  # made from the old jars
mv "$WORK/libs" "$HOME_DIR/libs"
echo "$VERSION" > "$HOME_DIR/installed"
echo "installed Apache Kafka $VERSION in $HOME_DIR ($(du -sh "$HOME_DIR/libs" | cut -f1), $(ls "$HOME_DIR/libs" | wc -l) jars, sha256 checked)"
