"""Provider presets: where each provider puts its event ID, how it signs, how long it retries.

A route's ``preset`` fills in these defaults; anything set explicitly on the route wins. Sources:
the providers' public documentation, linked per fact in docs/providers.md, which also says which
facts are unverified.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

DAY = 86400.0
HOUR = 3600.0
MIB = 1024 * 1024
# The share of a provider's deadline after which a route with ``redeliver`` keeps the delivery
# and answers, if the app has not: the rest is the network's and the keep's margin.
HAND_OFF_SHARE = 0.7


@dataclass(frozen=True, slots=True, kw_only=True)
class Preset:
    event_id: tuple[str, ...]
    event_type: str | None
    scheme: str | None  # signature scheme for ``verify``; None: not supported
    # At least the provider's retry (or redelivery) horizon, with a margin.
    retention: float
    # Forward requests without an event ID unclaimed (Slack's url_verification handshake).
    forward_missing_id: bool = False
    # Signature timestamp tolerance, when the scheme's default (5 minutes) is unsafe.
    tolerance: float | None = None
    # The route's default max_body: at least the provider's documented payload cap, so the proxy
    # never refuses (413) a body the provider may send. None: no documented cap, the global
    # max_body applies.
    max_body: int | None = None
    # The route's default claim_wait, below the provider's response deadline: a copy that waits
    # longer is answered after the provider has given up on it. None: the global claim_wait.
    claim_wait: float | None = None
    # The route's default on_duplicate: "replay" where the provider acts on the answer's body
    # (Twilio's TwiML), so a duplicate needs the first answer, not an acknowledgement.
    on_duplicate: str | None = None
    # How long the provider waits for the answer before it counts the delivery failed (its
    # documented delivery timeout; None: not published). A route with ``redeliver`` hands off
    # at ``HAND_OFF_SHARE`` of it by default (``routes.RouteConfig.hand_off``).
    deadline: float | None = None
    # ``order: preset``: where the provider names the object an event is about and its version
    # (docs/providers.md states each one's precision). Never applied unless a route asks.
    order: tuple[str, str] | None = None


PRESETS: dict[str, Preset] = {
    # Up to 3 days of retries in live mode.
    "stripe": Preset(
        event_id=("body:/id",),
        event_type="body:/type",
        scheme="stripe",
        retention=4 * DAY,
        order=("body:/data/object/id", "body:/created"),  # created: whole seconds
    ),
    # No automatic retries; manual redelivery reuses the GUID for 3 days. The GUID is shared by
    # every hook subscribed to the event, so the hook's ID is part of the key. Payloads are capped
    # at "25 MB": read as MiB, the larger reading, since a 413 is never retried.
    "github": Preset(
        event_id=("header:X-GitHub-Hook-ID", "header:X-GitHub-Delivery"),
        event_type="header:X-GitHub-Event",
        scheme="github",
        retention=4 * DAY,
        max_body=25 * MIB,
        deadline=10.0,  # 30 s on GitHub Enterprise Server 3.7 and later
    ),
    # 8 retries over 4 hours; X-Shopify-Event-Id is Shopify's documented deduplication key.
    "shopify": Preset(
        event_id=("header:X-Shopify-Event-Id",),
        event_type="header:X-Shopify-Topic",
        scheme="shopify",
        retention=DAY,
        deadline=5.0,  # for the whole request, connecting included
        order=("body:/id", "header:X-Shopify-Triggered-At"),
    ),
    # Svix's schedule spans about 28 hours.
    "standard-webhooks": Preset(
        event_id=("header:webhook-id",),
        event_type="body:/type",
        scheme="standard-webhooks",
        retention=2 * DAY,
        deadline=15.0,  # the spec recommends 15 to 30 s to senders: the shorter
    ),
    "svix": Preset(
        event_id=("header:svix-id",),
        event_type="body:/type",
        scheme="standard-webhooks",
        retention=2 * DAY,
        deadline=15.0,
    ),
    # Resend and Clerk deliver through Svix (svix-* headers, Svix's schedule and timeout).
    "resend": Preset(
        event_id=("header:svix-id",),
        event_type="body:/type",
        scheme="standard-webhooks",
        retention=2 * DAY,
        deadline=15.0,
    ),
    "clerk": Preset(
        event_id=("header:svix-id",),
        event_type="body:/type",
        scheme="standard-webhooks",
        retention=2 * DAY,
        deadline=15.0,
    ),
    # Meta sends no delivery ID: the route names the field its product keys on (event_id is
    # required). Retries span 36 hours (Graph API webhooks), WhatsApp's up to 7 days
    # (unverified here): a week and a day. The subscription check (GET) is answered by the proxy.
    "meta": Preset(
        event_id=(),
        event_type=None,
        scheme="meta",
        retention=8 * DAY,
    ),
    # Linear's SDK refuses a webhookTimestamp a minute off; retries after 1 min, 1 h and 6 h,
    # each re-signed with a fresh timestamp (unverified: the SDK's check implies it). Whether
    # Linear-Delivery is the same on a retry is unverified.
    "linear": Preset(
        event_id=("header:Linear-Delivery",),
        event_type="body:/type",
        scheme="linear",
        retention=DAY,
        tolerance=60.0,
        deadline=5.0,
    ),
    # Intercom's notification ID; its retry horizon is unpublished (it suspends a subscription
    # after seven days of errors): a week and a day.
    "intercom": Preset(
        event_id=("body:/id",),
        event_type="body:/topic",
        scheme="intercom",
        retention=8 * DAY,
    ),
    # Twitch EventSub: the message ID is the same on a resent message; the timestamp must be
    # within 10 minutes (Twitch's guidance); a callback verification is answered by the proxy,
    # and a revocation is claimed and forwarded like a notification. The retry horizon is
    # unpublished (a subscription that keeps failing is revoked): two days, unverified.
    "twitch": Preset(
        event_id=("header:Twitch-Eventsub-Message-Id",),
        event_type="body:/subscription/type",
        scheme="twitch",
        retention=2 * DAY,
        tolerance=600.0,
    ),
    # Discord interactions: never retried; the app's answer is the interaction's response, so a
    # duplicate replays it; Discord waits 3 s for it (a copy waits 2 s, as Slack's). The PING
    # is answered by the proxy. verify.secret is the application's public key.
    "discord": Preset(
        event_id=("body:/id",),
        event_type="body:/type",
        scheme="discord",
        retention=DAY,
        claim_wait=2.0,
        on_duplicate="replay",
        deadline=3.0,
    ),
    # Zoom sends no delivery ID (x-zm-trackingid's stability across retries is unverified):
    # the route names its event_id. Retries after 5, 20 and 60 minutes; 3 s to answer. The
    # endpoint.url_validation is answered by the proxy.
    "zoom": Preset(
        event_id=(),
        event_type="body:/event",
        scheme="zoom",
        retention=DAY,
        claim_wait=2.0,
        deadline=3.0,
    ),
    # Signs only timestamp + token, not the event data (docs/providers.md): claimed by the signed
    # token, and the tolerance (12 h: retries span 8 hours and whether a retry is re-signed is
    # unverified) below the retention, so a captured signature is a duplicate or stale.
    "mailgun": Preset(
        event_id=("body:/signature/token",),
        event_type="body:/event-data/event",
        scheme="mailgun",
        retention=2 * DAY,
        tolerance=12 * HOUR,
    ),
    # SendGrid's Event Webhook posts a batch (an array of events, each with its sg_event_id):
    # keyed by every sg_event_id in it (event_ids: one event's as it is, several hashed), so a
    # batch regrouped on a retry is forwarded again, never dropped. Retries span 24 hours;
    # whether a retry is re-signed with a fresh timestamp is unverified, so, as for Paddle, the
    # window spans the retention, inside which a replay is a duplicate anyway. No event type:
    # a batch mixes them. verify.secret is the verification key (public).
    "sendgrid": Preset(
        event_id=("body:/*/sg_event_id",),
        event_type=None,
        scheme="sendgrid",
        retention=2 * DAY,
        tolerance=2 * DAY,
    ),
    # HubSpot posts a batch of up to 100 events; eventId may not be unique on its own (its
    # webhooks page, as recalled: unverified), so each event is keyed with its portal and
    # subscription. Each retry
    # (up to 10 over 24 hours) is a new body (attemptNumber) re-signed at a fresh timestamp:
    # HubSpot's 5 minutes. verify needs public_url, as Twilio's does.
    "hubspot": Preset(
        event_id=("body:/*/portalId", "body:/*/subscriptionId", "body:/*/eventId"),
        event_type=None,
        scheme="hubspot",
        retention=2 * DAY,
    ),
    # Adyen signs each NotificationRequestItem's key fields (not the body, no timestamp), with
    # an HMAC key in hex. An event is its pspReference, eventCode and success (an AUTHORISATION
    # refused, then one that succeeded, are two); a body's items are keyed together as a batch.
    # A failing webhook is retried for 30 days; any 2xx accepts it (Adyen no longer needs
    # "[accepted]"). A replay after the retention is forwarded again: nothing signed ages.
    "adyen": Preset(
        event_id=tuple(
            f"body:/notificationItems/*/NotificationRequestItem/{name}"
            for name in ("pspReference", "eventCode", "success")
        ),
        event_type="body:/notificationItems/0/NotificationRequestItem/eventCode",
        scheme="adyen",
        retention=31 * DAY,
    ),
    # AWS SNS over HTTPS: signed with RSA under a certificate fetched from sns.<region>.
    # amazonaws.com only; verify.secrets are the topic ARNs the route takes. A retry is the
    # same signed message (its Timestamp is the publish time): the tolerance spans the retry
    # horizon (an hour at most, by the delivery policy's limits: unverified) with a wide margin,
    # below the retention, so a replay is a duplicate or stale. A SubscriptionConfirmation is
    # claimed by its MessageId and forwarded: the app confirms it.
    "sns": Preset(
        event_id=("body:/MessageId",),
        event_type="body:/Type",
        scheme="sns",
        retention=2 * DAY,
        tolerance=DAY,
    ),
    # 3 retries within minutes; the url_verification handshake carries no event_id. Slack gives
    # up on an answer after 3 s (and retries while the first copy may still run): a copy waits 2 s.
    "slack": Preset(
        event_id=("body:/event_id",),
        event_type="body:/event/type",
        scheme="slack",
        retention=DAY,
        forward_missing_id=True,
        claim_wait=2.0,
        deadline=3.0,
    ),
    # Whether a retry is re-signed with a fresh ts is unverified; if it is not, a 5-minute
    # window would refuse every retry and lose the event. A replay inside the retention window
    # is a duplicate anyway, so the window spans the retention.
    "paddle": Preset(
        event_id=("body:/event_id",),
        event_type="body:/event_type",
        scheme="paddle",
        retention=4 * DAY,
        tolerance=4 * DAY,
        deadline=5.0,
        order=("body:/data/id", "body:/occurred_at"),
    ),
    # Twilio retries only within one callback's own time budget (the URL fragment's rc/tt
    # overrides; how long at most is unverified): a day is a wide margin. The idempotency token
    # is not signed (docs/security.md); the answer is TwiML that Twilio acts on, so a duplicate
    # replays it. Its 15 s timeout is above the default claim_wait. verify needs public_url.
    "twilio": Preset(
        event_id=("header:I-Twilio-Idempotency-Token",),
        event_type=None,
        scheme="twilio",
        retention=DAY,
        on_duplicate="replay",
        deadline=15.0,  # connecting included
    ),
    # Square signs the notification URL it was given and the body (verify needs public_url, as
    # Twilio's does); no timestamp. Square's 10 s is unverified (its pages disagree).
    "square": Preset(
        event_id=("body:/event_id",),
        event_type="body:/type",
        scheme="square",
        retention=4 * DAY,
        deadline=10.0,
    ),
    # PayPal signs with RSA under a certificate fetched from its own hosts; the secrets are the
    # webhook IDs. Whether a retry is signed with a fresh transmission time is unverified: as
    # for Paddle, the window spans the retention, inside which a replay is a duplicate anyway.
    # PayPal publishes no delivery timeout.
    "paypal": Preset(
        event_id=("body:/id",),
        event_type="body:/event_type",
        scheme="paypal",
        retention=4 * DAY,
        tolerance=4 * DAY,
        order=("body:/resource/id", "body:/create_time"),
    ),
}


def parse_name(value: object) -> str:
    """A preset's name in any case (``GitHub`` is ``github``, as the provider spells itself);
    ValueError naming the nearest preset for a misspelt one, never picking it: a route signed
    and keyed as another provider's would refuse or mis-key every webhook."""
    name = value.lower() if isinstance(value, str) else ""
    if name in PRESETS:
        return name
    close = difflib.get_close_matches(name, PRESETS, n=1)
    hint = f": did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"must be one of {', '.join(PRESETS)}; got {value!r}{hint}")
