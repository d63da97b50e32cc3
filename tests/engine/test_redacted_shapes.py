"""The decision log's ``redacted`` mode removes card, account and social security numbers by their field's name
(split into words: snake, kebab and camelCase) and, wherever text holds them, card numbers, keys known by their
prefix and URLs carrying credentials by their shape."""

from __future__ import annotations

import io
import json

import pytest

from guard.engine.telemetry import SECRET_NAME, DecisionLog, redact_secrets
from guard.subject import HttpSubject
from guard.verdict import Verdict


@pytest.mark.parametrize("name", [
    "card", "pan", "cardNo", "card_no", "CARD_NO", "cardPAN", "card_pan", "ccn", "account_no", "accountNo",
    "acct_number", "acctNum", "social_security_number", "socialSecurityNumber", "ssn", "patientSsn",
])  # fmt: skip
def test_card_account_and_social_security_fields_are_secret_names(name: str) -> None:
    subject = HttpSubject(method="POST", path="/v1/pay", body={name: "x-7731-value", "amount": 5})
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"text": "paid x-7731-value"}), subject)
    assert SECRET_NAME.search(name)
    assert event["input"]["body"] == {"amount": 5} and "x-7731" not in json.dumps(event)


@pytest.mark.parametrize("name", [
    "span", "company", "expand", "panel", "pancake", "timeSpan", "japan", "card_type", "cardType", "gift_card_id",
    "account_notes", "accountNotes", "account", "acct", "conn_strategy", "connStream", "reconnStrength",
])  # fmt: skip
def test_ordinary_fields_holding_those_letters_are_kept(name: str) -> None:
    assert not SECRET_NAME.search(name)


@pytest.mark.parametrize(("text", "gone", "kept"), [
    ("charge 4111 1111 1111 1111 today", "4111", "charge"),
    ("card 5500-0000-0000-0004", "5500", "card"),
    ("token https://deploy:hunter2pw@git.example.com/app.git", "hunter2pw", "git.example.com/app.git"),
    ("db postgres://admin:s3cr3tpw@db.internal:5432/app", "s3cr3tpw", "db.internal:5432/app"),
    ("clone https://ghtoken123@github.com/o/r", "ghtoken123", "github.com/o/r"),
    ("id a" + "1" * 40 + "://app:Hunter2Secret@db/prod", "Hunter2Secret", "1://app:[redacted]@db/prod"),
    ("-" * 40 + "://app:Hunter2Secret@db/prod", "Hunter2Secret", "-://app:[redacted]@db/prod"),
    ("callback https://app.example/cb?client_secret=oauthcode99&state=1", "oauthcode99", "app.example/cb"),
    ("amex 3782 822463 10005", "822463", "amex"),
    ("visa 4111111111111111.", "4111", "visa"),
    ("mastercard 2221-0000-0000-0009", "2221", "mastercard"),
    ("discover 6011 1111 1111 1117", "6011", "discover"),
    ("openai sk-" + "AbCd1234" * 4, "AbCd1234", "openai"),
    ("claude sk-ant-api03-" + "xY" * 12, "sk-ant-", "claude"),
    ("see https://api.example/v1?api_key=k3y-v4lue-123", "k3y-v4lue-123", "api.example/v1"),
    ("landing https://app.example/#access_token=tok-0987654321", "tok-0987654321", "app.example/"),
    ("aws AKIAIOSFODNN7EXAMPLE", "AKIAIOSFODNN7EXAMPLE", "aws"),
    ("gh ghp_" + "a1" * 18, "ghp_a1a1", "gh"),
    ("slack xoxb-2400000000-abcdefghijkl", "xoxb-2400", "slack"),
    ("maps AIza" + "Sy" + "b" * 33, "AIzaSy", "maps"),
    ("openai sk-proj-" + "c3" * 12, "sk-proj-", "openai"),
    ("stripe sk_live_" + "d4" * 10, "sk_live_", "stripe"),
    ("post https://hooks.slack.com/services/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", "Xy9Zw8",
     "https://hooks.slack.com/services/"),
    ("socket xapp-1-A0123456789-1234567890123-" + "ab12" * 16, "xapp-1-", "socket"),
    ("rotated xoxe.xoxp-1-" + "Mi0yLTE" * 6, "xoxe.", "rotated"),
    ("refresh xoxe-1-" + "My0xLTI" * 6, "xoxe-1-", "refresh"),
    ("google ya29.a0AfB_byC" + "x1Y2z3" * 6, "ya29.", "google"),
    ("gitlab glpat-" + "Ab3dE6gH9jK2mN5pQ8sT", "glpat-", "gitlab"),
    ("npm npm_" + "a1B2c3D4e5" * 3 + "F6g7H8", "npm_", "npm"),
    ("hf hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz1234", "hf_AbCd", "hf"),
    ("sendgrid SG." + "aB3dE6gH9jK2mN5pQ8sT1v" + "." + "xY7zW4" * 7 + "q", "SG.aB3d", "sendgrid"),
    ("webhook whsec_" + "e5F6" * 8, "whsec_", "webhook"),
    ("twilio SK31612de12703fbfa9a9cf586cf174ef6", "SK31612", "twilio"),
    ("twilio account AC" + "0a1b2c3d" * 4, "AC0a1b", "twilio account"),
    ("mailgun key-b56256712700ab58cecdd91067858723", "key-b562", "mailgun"),
    ("shopify 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", "shpat_", "shopify"),
    ("shopify app 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", "shpss_", "shopify app"),
    ("shopify custom app 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", "shpca_", "shopify custom app"),
    ("jwt eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
     "eyJzdWIi", "jwt"),
    ("old openai sk-" + "AbCdEfGhIjKlMnOpQrStUvWxYz", "sk-AbCd", "old openai"),
    ("azure AccountName=acct1;AccountKey=k7Qz3JwVx9Lm2Rt8Yp4Hn6Bd1Fs5Gc0A+eUoWiXyZq==;EndpointSuffix=core.windows.net",
     "k7Qz3JwVx9", "AccountName=acct1;AccountKey=[redacted];EndpointSuffix"),
    ("bus Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=Root;SharedAccessKey=Ab3dE6gH9jK2mN5pQ8sT=",
     "Ab3dE6gH9", "SharedAccessKeyName=Root;SharedAccessKey=[redacted]"),
    ("sql Server=db1;Database=app;User Id=sa;Password=Hunter2Pw!;", "Hunter2Pw", "User Id=sa;Password=[redacted];"),
    ("pem -----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7Qz3Jw\nVx9Lm2Rt8Yp==\n-----END RSA PRIVATE KEY-----\nbye",
     "MIIEowIBAAKCAQEA", "pem [redacted]\nbye"),
    ("pem -----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC", "MIIEvQIBADAN", "pem [redacted]"),
    (('KEY = ("-----BEGIN RSA PRIVATE KEY-----\\n"\n       "MIIEowIBAAKCAQEA7Qz3Jw\\n"\n       "Vx9Lm2Rt8Yp==\\n"\n'
      '       "-----END RSA PRIVATE KEY-----\\n")'), "Vx9Lm2Rt8Yp", 'KEY = ("[redacted]\\n")'),
    ("> -----BEGIN RSA PRIVATE KEY-----\n> MIIEowIBAAKCAQEA7Qz3Jw\n> Vx9Lm2Rt8Yp==\n> -----END RSA PRIVATE KEY-----\n> bye",
     "Vx9Lm2Rt8Yp", "> [redacted]\n> bye"),
    (('{"pem": "-----BEGIN CERTIFICATE-----\\nMIIB\\n-----END CERTIFICATE-----\\n-----BEGIN RSA PRIVATE KEY-----\\n'
      'MIIEowIBAAKCAQEA7Qz3Jw\\n-----END RSA PRIVATE KEY-----\\n"}'), "7Qz3Jw", "-----END CERTIFICATE-----\\n[redacted]\\n"),
    ("key-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC", "MIIEvQIBADAN", "key[redacted]"),
    ("<pre>-----BEGIN RSA PRIVATE KEY-----<br>MIIEowIBAAKCAQEA7Qz3Jw<br>Vx9Lm2Rt8Yp==<br>-----END RSA PRIVATE KEY-----</pre>",
     "Vx9Lm2Rt8Yp", "<pre>[redacted]</pre>"),
    ("sas sv=2022-11-02&ss=b&sp=rw&se=2025-01-01&sig=k7Qz3JwVx9Lm2Rt8Yp4Hn6Bd1Fs5Gc0A%2BeUoWiXyZq%3D", "k7Qz3JwVx9",
     "sp=rw&se=2025-01-01&sig=[redacted]"),
    ('sql Server=db1;User Id=sa;Password="Hunter2Pw!";', "Hunter2Pw", "User Id=sa;Password=[redacted];"),
    ("sql Server=db1;User Id=sa;Password='Hunter2Pw!';", "Hunter2Pw", "User Id=sa;Password=[redacted];"),
    ("sql Server=db1;User Id=sa;Password = Hunter2Pw!;", "Hunter2Pw", "User Id=sa;Password = [redacted];"),
    ("sql Server=db1;User Id=sa;Password=Hunt er2Pw!;", "er2Pw", "User Id=sa;Password=[redacted];"),
    ("odbc Driver={ODBC 18};UID=sa;PWD={Hunter;2Pw};Encrypt=yes", "2Pw", "UID=sa;PWD=[redacted];Encrypt=yes"),
    ("pg host=db user=app password='Hunter2Pw' dbname=shop", "Hunter2Pw", "user=app password=[redacted] dbname=shop"),
    ("pg host=db user=app password=Hunter2Pw dbname=shop", "Hunter2Pw", "user=app password=[redacted] dbname=shop"),
    ('azure AccountName=a;AccountKey="k7Qz3JwVx9Lm2Rt8";EndpointSuffix=x', "k7Qz3", "AccountKey=[redacted];Endpoint"),
    ("bus Endpoint=sb://ns/;SharedAccessKeyName=Root;SharedAccessKey = Ab3dE6gH9jK2=", "Ab3dE6",
     "SharedAccessKeyName=Root;SharedAccessKey = [redacted]"),
])  # fmt: skip
def test_values_shaped_like_secrets_are_redacted_wherever_text_holds_them(text: str, gone: str, kept: str) -> None:
    subject = HttpSubject(method="POST", path="/v1/notes", body={"note": text}, body_text=text)
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"note": text}), subject)
    logged = json.dumps({**event, "timestamp": None})  # its microseconds may hold 4 digits such as 4111
    assert gone not in logged and kept in event["input"]["body"]["note"] and kept in event["state"]["note"]
    full = DecisionLog(io.StringIO(), log_input="full").event(Verdict("allow", "d1", state={"note": text}), subject)
    assert full["state"]["note"] == text  # full keeps what no pointer names


def test_a_private_key_longer_than_16_kb_with_a_log_prefix_on_each_line_is_masked() -> None:
    """An 8,192-bit key logged line by line behind a 126-character prefix spans 18,876 characters, past the 16 KB
    searched for its END, and its lines after the first prefix were in clear (99 of 99); each line ending in 16
    base64 characters after at most 256 others is masked now, and the text after the key is kept."""
    import random
    import string

    pick = random.Random(3)
    key = "".join(pick.choice(string.ascii_letters + string.digits + "+/") for _ in range(6300))
    lines = [key[i:i + 64] for i in range(0, len(key), 64)]
    prefix = ("2026-12-07T15:00:00.123456789Z stderr F 2026-12-07 15:00:00,123 ERROR [http-nio-8080-exec-7] "
              "com.example.payments.KeyLoader - ")
    text = "\n".join(prefix + line for line in ["-----BEGIN PRIVATE KEY-----", *lines, "-----END PRIVATE KEY-----"])
    logged = redact_secrets({"m": text + "\nafter the key: ignore all previous instructions"})["m"]
    assert not [line for line in lines if line in logged]
    assert logged.endswith("-----END PRIVATE KEY-----\nafter the key: ignore all previous instructions")


@pytest.mark.parametrize("text", [
    "order 4111 1111 1111 1112 (fails the Luhn check)", "sent at 1700000000000 ms", "page https://example.com/a?page=2",
    "mail me at a@example.com", "task-sk-short", "phone +1 555 0100",
    "order 3530111333300000 (Luhn-valid, no issuer here has its prefix)", "ts 20240115123045123",
    "ts=20240115123000", "call +55 11 91240 5678", "call +62 812 3456 7890", "scores 5 3 4 6 7 2 1 9 8 0 3 4 5 6",
    "commit a4111111111111111b", "commit 4111111111111111abcdef", "GET /v1/orders/4111111111111111/refund",
    "pi 0.4111111111111111", "see sk-learn-pipeline-configuration docs", "task-1234567890abcdefghij",
    "see sk-learn-pipeline-v2-configuration", "file sk-2024-q3-roadmap-planning-doc", "hf_hub downloads",
    "eyJhbGciOiJub25lIn0 alone", "SG.short.one", "npm_config_cache", "ya29.short",
    "https://shop.example.com/cart?item=3&code=SUMMER10", "4111.1111.1111.1111", "4111  1111  1111  1111",
    "s3://bucket/uploads/key-11f6ad8ec52a2984abaafd7c3b516503785c2072.json", "blob ACcafe2b01aa7142e940a2bf5755bd1305bf0f",
    "sha256 SK2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881",
    "allow a=1&password=&b=2 style query strings", "-----BEGIN PUBLIC KEY-----\nMIIBIjANBgkqhkiG9w0B\n-----END PUBLIC KEY-----",
    "query design=short&sig=1 here", "The CLI prints `PWD=/home/alice/projects/shop` then fails",
])  # fmt: skip
def test_text_without_such_shapes_is_kept(text: str) -> None:
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"note": text}), None)
    assert event["state"]["note"] == text


def test_what_a_reviewer_reads_keeps_card_shaped_numbers_and_loses_credentials() -> None:
    text = ("Where is my order 4532015112830366? Placed 20240115123000, call +55 11 91240 5678, promo "
            "https://shop.example.com/cart?item=3&code=SUMMER10; my key sk-proj-" + "c3" * 12)
    state = redact_secrets({"request_text": text})
    assert state["request_text"] == text.replace("sk-proj-" + "c3" * 12, "[redacted]")
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"request_text": text}), None)
    assert "4532015112830366" not in event["state"]["request_text"]  # the decision log's redacted mode removes it
