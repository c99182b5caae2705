#!/bin/bash
# This plan's job folder through ../gather_jobs.sh (its files under /tmp/res; $OUT/res.tgz when OUT is set).
exec bash "$(dirname "$0")/../gather_jobs.sh" /tmp/smol2l
