#!/bin/bash
# This plan's job folders through ../gather_jobs.sh (their files under /tmp/res; $OUT/res.tgz when OUT is set).
exec bash "$(dirname "$0")/../gather_jobs.sh" /tmp/smolall /tmp/smolallk2
