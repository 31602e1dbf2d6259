#!/usr/bin/env bash
# Resolves the Apache Kafka broker of tools/kafka/pom.xml (kafka_2.13, kafka-tools and their
# dependencies, from Maven Central) into ~/.cache/agenteval/kafka/<sha256 of pom.xml>/libs, unless
# it is already there; prints that directory. `path` prints it without resolving (the tests look
# there). Needs Java 17+ and Maven. tests/kafka.py runs the broker in KRaft mode from these jars.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
sum="$(sha256sum "$here/pom.xml" | cut -d' ' -f1)"
libs="${XDG_CACHE_HOME:-$HOME/.cache}/agenteval/kafka/$sum/libs"
if [ "${1:-}" = path ]; then echo "$libs"; exit 0; fi
if [ ! -f "$libs/.complete" ]; then
  command -v java >/dev/null || { echo "tools/kafka/kafka.sh: Java is not installed (apt-get install openjdk-17-jre-headless)" >&2; exit 1; }
  command -v mvn >/dev/null || { echo "tools/kafka/kafka.sh: Maven is not installed (apt-get install maven)" >&2; exit 1; }
  mkdir -p "$(dirname "$libs")"
  work="$(mktemp -d "$(dirname "$libs")/resolve.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  echo "resolving the Kafka broker from Maven Central (first time only)" >&2
  mvn -q -B -f "$here/pom.xml" dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$work/libs" >&2
  touch "$work/libs/.complete"
  rm -rf "$libs"
  mv "$work/libs" "$libs"
fi
echo "$libs"
