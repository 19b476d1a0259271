-- pgbench script: one claim transaction as the proxy runs it, with a unique event ID, on the
-- table bench/run.py creates (bench_claims, the proxy's own DDL). Run with -M prepared and
-- -M simple:  pgbench -n -M prepared -c 32 -j 2 -T 10 -f bench/claim.sql DSN
BEGIN ISOLATION LEVEL READ COMMITTED;
INSERT INTO bench_claims (scope, event_id, event_type, body_sha256)
    VALUES ('bench', gen_random_uuid()::text || '-pgb-' || :client_id, NULL,
            '\x00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff'::bytea)
    ON CONFLICT (scope, event_id) DO NOTHING RETURNING true;
COMMIT;
