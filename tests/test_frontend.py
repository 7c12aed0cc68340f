"""Text front end: English and Mandarin normalisation, espeak-ng / pinyin G2P, segmentation."""

import re
import shutil
import subprocess

import pytest
from hypothesis import given, settings, strategies as st

from orchestrator.frontend import (
    FrontEnd,
    Segment,
    StreamingSegmenter,
    detect_language,
    split_sentences,
    text_units,
)
from orchestrator.frontend.espeak_lib import EspeakLibraryError
from orchestrator.frontend.g2p import EspeakG2P, G2PError, PassthroughG2P, build_g2p, to_pinyin
from orchestrator.frontend.normalize_en import cardinal, normalize_en, ordinal, year
from orchestrator.frontend.normalize_zh import cardinal_zh, normalize_zh

needs_espeak = pytest.mark.skipif(
    shutil.which("espeak-ng") is None, reason="espeak-ng missing (make test installs it)"
)

# --- English ---------------------------------------------------------------------------------
EN_CASES = [
    # cardinals, decimals, negatives
    ("I have 123 apples.", "I have one hundred twenty-three apples."),
    ("1,234,567", "one million two hundred thirty-four thousand five hundred sixty-seven"),
    ("0 and 1001", "zero and one thousand one"),
    ("Pi is 3.14", "Pi is three point one four"),
    (".5 or 1.05", "point five or one point zero five"),
    ("It fell to -42 today", "It fell to minus forty-two today"),
    ("10 - 3", "ten minus three"),
    # ordinals
    (
        "the 1st, 2nd, 3rd, 11th, 22nd and 101st",
        "the first, second, third, eleventh, twenty-second and one hundred first",
    ),
    # years and decades
    ("In 1999 we met.", "In nineteen ninety-nine we met."),
    ("in 2005 and in 2010", "in two thousand five and in twenty ten"),
    ("since 1905, by 1900", "since nineteen oh five, by nineteen hundred"),
    ("Born 2026.", "Born twenty twenty-six."),
    ("the 1990s and the '80s", "the nineteen nineties and the eighties"),
    ("I have 2026 cats", "I have two thousand twenty-six cats"),
    ("1990-2000", "nineteen ninety to two thousand"),
    # dates
    ("On 2026-11-30.", "On November thirtieth, twenty twenty-six."),
    ("30/11/2026", "November thirtieth, twenty twenty-six"),
    ("11/30/2026", "November thirtieth, twenty twenty-six"),
    ("Nov 30, 2026", "November thirtieth, twenty twenty-six"),
    ("December 25th", "December twenty-fifth"),
    ("5 March 2026", "the fifth of March, twenty twenty-six"),
    ("in May 2026", "in May twenty twenty-six"),
    # times
    ("at 3:45 pm", "at three forty-five PM"),
    ("at 3:05", "at three oh five"),
    ("at 10am or 7 p.m.", "at ten AM or seven PM."),
    ("at 12:00", "at twelve o'clock"),
    ("9:05:30", "nine oh five and thirty seconds"),
    # currency
    ("$5.20", "five dollars and twenty cents"),
    ("$1 or $0.99 or $0.01", "one dollar or ninety-nine cents or one cent"),
    ("€3.50 and £1.01", "three euros and fifty cents and one pound and one penny"),
    ("¥100", "one hundred yen"),
    ("$2.5 million", "two point five million dollars"),
    ("$5k", "five thousand dollars"),
    ("-$5", "minus five dollars"),
    ("10 USD", "ten US dollars"),
    # percent and units
    ("50% or 3.5 %", "fifty percent or three point five percent"),
    ("5 km at 10 mph", "five kilometers at ten miles per hour"),
    ("1 km, 1.5 L, 3 kg", "one kilometer, one point five liters, three kilograms"),
    ("-5°C and 98.6°F", "minus five degrees Celsius and ninety-eight point six degrees Fahrenheit"),
    ("2 GB of 512 MB", "two gigabytes of five hundred twelve megabytes"),
    ("60 km/h", "sixty kilometers per hour"),
    ("500 ms", "five hundred milliseconds"),
    ("5-10 km", "five to ten kilometers"),
    # abbreviations
    ("Dr. Smith lives on Oak Dr. now", "Doctor Smith lives on Oak Drive now"),
    ("St. Louis and Main St. etc.", "Saint Louis and Main Street et cetera."),
    ("Mr. and Mrs. Lee vs. Prof. Chen", "Mister and Missus Lee versus Professor Chen"),
    ("e.g. this, i.e. that", "for example this, that is that"),
    ("No. 5", "number five"),
    ("I ate a fig.", "I ate a fig."),
    # symbols
    ("Tom & Jerry", "Tom and Jerry"),
    ("1 + 1 = 2", "one plus one equals two"),
    ("#1 and #AI", "number one and hashtag AI"),
    ("meet @ noon", "meet at noon"),
    ("1/2 and 2/3", "one half and two thirds"),
    ("1½ cups", "one and a half cups"),
    # phone-like digit strings
    ("Call 555-123-4567", "Call five five five, one two three, four five six seven"),
    ("+1 (555) 123-4567", "plus one, five five five, one two three, four five six seven"),
    ("code 007", "code zero zero seven"),
    ("1234567890", "one two three four five six seven eight nine zero"),
    # addresses
    ("Visit https://www.example.com/docs", "Visit w w w dot example dot com slash docs"),
    ("Mail john.doe@example.com.", "Mail john dot doe at example dot com."),
    # mixed letters and digits
    ("MP3 and COVID-19", "MP three and COVID nineteen"),
]


@pytest.mark.parametrize("text,expected", EN_CASES)
def test_normalize_en(text, expected):
    assert normalize_en(text) == expected


@pytest.mark.parametrize(
    "n,words",
    [
        (0, "zero"),
        (13, "thirteen"),
        (40, "forty"),
        (99, "ninety-nine"),
        (105, "one hundred five"),
        (1000, "one thousand"),
        (12345, "twelve thousand three hundred forty-five"),
        (10**6, "one million"),
        (2 * 10**9 + 1, "two billion one"),
        (-7, "minus seven"),
    ],
)
def test_cardinal(n, words):
    assert cardinal(n) == words


@pytest.mark.parametrize(
    "n,words",
    [
        (1, "first"),
        (2, "second"),
        (5, "fifth"),
        (12, "twelfth"),
        (20, "twentieth"),
        (43, "forty-third"),
        (100, "one hundredth"),
    ],
)
def test_ordinal(n, words):
    assert ordinal(n) == words


@pytest.mark.parametrize(
    "n,words",
    [
        (1999, "nineteen ninety-nine"),
        (2005, "two thousand five"),
        (2000, "two thousand"),
        (2010, "twenty ten"),
        (1905, "nineteen oh five"),
        (1800, "eighteen hundred"),
    ],
)
def test_year(n, words):
    assert year(n) == words


_NUMBERISH = st.one_of(
    st.integers(-(10**12), 10**12).map(str),
    st.floats(0, 1e6, allow_nan=False).map(lambda f: f"{f:.2f}"),
    st.integers(0, 10**6).map(lambda n: f"${n:,}"),
    st.integers(0, 999).map(lambda n: f"{n}%"),
    st.integers(1, 99).map(lambda n: f"{n}th"),
    st.integers(0, 23).map(lambda h: f"{h}:{h * 2 % 60:02d}"),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_NUMBERISH, min_size=1, max_size=4))
def test_normalize_en_leaves_no_digits(parts):
    out = normalize_en("Here " + " and ".join(parts) + ".")
    assert not re.search(r"\d", out), out


# --- Mandarin --------------------------------------------------------------------------------
ZH_CASES = [
    # cardinals with 零 rules, decimals, negatives
    ("我有123个苹果", "我有一百二十三个苹果"),
    ("10086", "一万零八十六"),
    ("100100", "十万零一百"),
    ("100000001", "一亿零一"),
    ("1,234", "一千二百三十四"),
    ("圆周率是3.14", "圆周率是三点一四"),
    ("温度-5度", "温度负五度"),
    # 两 where idiomatic
    ("2个人和2000人", "两个人和两千人"),
    ("12个和22个", "十二个和二十二个"),
    ("2万人", "两万人"),
    ("第2名", "第二名"),
    # years and dates
    ("2026年", "二零二六年"),
    ("2026年11月30日", "二零二六年十一月三十日"),
    ("2026-11-30", "二零二六年十一月三十日"),
    ("11月30日和5号", "十一月三十日和五号"),
    ("10年", "十年"),
    # times
    ("3:45", "三点四十五分"),
    ("2:05", "两点零五分"),
    ("12:00", "十二点"),
    ("10:05:09", "十点零五分零九秒"),
    # percent
    ("50%", "百分之五十"),
    ("3.5%", "百分之三点五"),
    # currency
    ("¥5", "五元"),
    ("￥5.20", "五元二角"),
    ("¥5.05", "五元零五分"),
    ("¥0.5", "五角"),
    ("5元和2元", "五元和两元"),
    ("$2", "两美元"),
    ("€10", "十欧元"),
    # units
    ("5km", "五公里"),
    ("2kg", "两公斤"),
    ("25°C", "二十五摄氏度"),
    ("60km/h", "六十公里每小时"),
    # phone numbers digit by digit
    ("13812345678", "一三八一二三四五六七八"),
    ("010-12345678", "零一零 一二三四五六七八"),
    ("+86 138 1234 5678", "加八六 一三八 一二三四 五六七八"),
    # fractions, ranges, symbols
    ("1/3", "三分之一"),
    ("1-3个", "一到三个"),
    ("3~5天", "三到五天"),
    ("1+1=2", "一加一等于二"),
    # full-width forms and punctuation
    ("１２３", "一百二十三"),
    ("Ｈｅｌｌｏ　ｗｏｒｌｄ", "Hello world"),
    ("你好,世界!", "你好，世界！"),
    ("真的?是的.", "真的？是的。"),
    # English words kept
    ("我喜欢Python, 它很好", "我喜欢Python，它很好"),
    ("iPhone 15", "iPhone 十五"),
]


@pytest.mark.parametrize("text,expected", ZH_CASES)
def test_normalize_zh(text, expected):
    assert normalize_zh(text) == expected


def test_normalize_zh_phone_yao():
    assert normalize_zh("13812345678", yao=True) == "幺三八幺二三四五六七八"
    assert normalize_zh("电话110", yao=True) == "电话一百一十"  # not phone-shaped: a number


@pytest.mark.parametrize(
    "n,said",
    [
        (0, "零"),
        (2, "二"),
        (10, "十"),
        (12, "十二"),
        (20, "二十"),
        (101, "一百零一"),
        (110, "一百一十"),
        (200, "两百"),
        (1001, "一千零一"),
        (1010, "一千零一十"),
        (2000, "两千"),
        (2200, "两千二百"),
        (10001, "一万零一"),
        (20000, "两万"),
        (1000010, "一百万零一十"),
        (120000000, "一亿二千万"),
    ],
)
def test_cardinal_zh(n, said):
    assert cardinal_zh(n) == said


@settings(max_examples=60, deadline=None)
@given(st.lists(_NUMBERISH, min_size=1, max_size=4))
def test_normalize_zh_leaves_no_digits(parts):
    out = normalize_zh("这是" + "和".join(parts) + "。")
    assert not re.search(r"\d", out), out


@pytest.mark.parametrize(
    "text,lang",
    [("Hello", "en"), ("你好 world", "cmn"), ("", "en"), ("123", "en"), ("東京", "cmn")],
)
def test_detect_language(text, lang):
    assert detect_language(text) == lang


# --- G2P -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def espeak_en():
    g2p = EspeakG2P("en-us")
    yield g2p
    g2p.close()


@pytest.fixture(scope="module")
def espeak_cmn():
    g2p = EspeakG2P("cmn-latn-pinyin")
    yield g2p
    g2p.close()


@pytest.mark.parametrize(
    "text,pinyin",
    [
        ("中国", "zhong1 guo2"),
        ("银行", "yin2 hang2"),
        ("行走", "xing2 zou3"),
        ("我的", "wo3 de5"),
        ("我喜欢Python，好。", "wo3 xi3 huan1 Python, hao3."),
    ],
)
def test_to_pinyin(text, pinyin):
    assert to_pinyin(text) == pinyin


@needs_espeak
def test_espeak_english(espeak_en):
    out = espeak_en("Hello world, this is a test.")
    assert out == "h@l'oU w'3:ld DIs Iz a# t'Est"
    assert espeak_en("Hello world, this is a test.") == out  # deterministic (and cached)
    assert espeak_en("Goodbye") and espeak_en("Goodbye") != espeak_en("Hello")


@needs_espeak
def test_espeak_mandarin_via_pinyin(espeak_cmn):
    out = espeak_cmn("你好，世界。")
    assert out.startswith("n'i35_|") and "_|" in out
    assert espeak_cmn("你好，世界。") == out
    assert espeak_cmn("谢谢") != out


def _espeak_cli(line: str, voice: str) -> str:
    out = subprocess.run(
        ["espeak-ng", "-q", "-x", "-b", "1", "-v", voice],
        input=line.encode(),
        capture_output=True,
        check=True,
    ).stdout.decode()
    return " ".join(x.strip() for x in out.splitlines() if x.strip())


@needs_espeak
def test_espeak_tricky_inputs_leave_later_answers_alone(espeak_en, espeak_cmn):
    """Inputs that make espeak-ng print blank lines or nothing must not disturb later answers."""
    for g2p, tricky, plain in [
        (
            espeak_en,
            ["...", "- - -", "Hello ... world", "😀", "zqxjk"],
            ["Good morning", "What a day"],
        ),
        (espeak_cmn, ["ni3 hao3 ... , .", "……", "。。。"], ["早上好", "今天天气很好"]),
    ]:
        for text in tricky:
            g2p._line.cache_clear()
            g2p(text)
        for text in plain:
            g2p._line.cache_clear()
            assert g2p(text) == _espeak_cli(to_pinyin(text) if g2p.pinyin else text, g2p.voice)


@needs_espeak
def test_espeak_long_text_is_chunked(espeak_en):
    text = "one two three four five six seven eight nine ten " * 30  # over espeak's 1000-byte line
    out = espeak_en(text)
    assert out.count("t'En") == 30  # every "ten" made it through


@needs_espeak
def test_espeak_keep_punctuation():
    g2p = EspeakG2P("en-us", keep_punctuation=True)
    try:
        assert (
            g2p("Hello world, this is a test; ok? Yes.")
            == "h@l'oU w'3:ld, DIs Iz a# t'Est; ,oUk'eI? j'Es."
        )
    finally:
        g2p.close()


def test_espeak_library_failure_is_a_g2p_error():
    def broken(line: str, voice: str) -> list[str]:
        raise EspeakLibraryError("espeak-ng failed on a line (status 1)")

    with pytest.raises(G2PError, match="failed on a line"):
        EspeakG2P("en-us", phonemize=broken)("hello")


@needs_espeak
def test_espeak_unknown_voice():
    with pytest.raises(G2PError, match="does not exist"):
        EspeakG2P("xx-no-such-voice")


def test_build_g2p():
    assert isinstance(build_g2p({"g2p": "none"}), PassthroughG2P)
    assert build_g2p({"g2p": "none"})("abc 你好") == "abc 你好"
    with pytest.raises(ValueError, match="unknown g2p"):
        build_g2p({"g2p": "festival"}, "en-US")
    with pytest.raises(ValueError, match="espeak_voice"):
        build_g2p({"g2p": "espeak-ng"}, "de-DE")


# --- FrontEnd --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def frontend():
    fe = FrontEnd(
        {
            "en-US": {"g2p": "espeak-ng", "espeak_voice": "en-us"},
            "cmn-CN": {"g2p": "espeak-ng", "espeak_voice": "cmn-latn-pinyin"},
        }
    )
    yield fe
    fe.close()


@needs_espeak
def test_frontend_english(frontend):
    segs = frontend.process("It costs $5. Dr. Smith paid... ", "en-US")
    assert [s.text for s in segs] == ["It costs $5.", "Dr. Smith paid..."]
    assert segs[0].normalized == "It costs five dollars."
    assert segs[0].model_input == "It k'O2sts f'aIv d'0l3z"
    assert all(s.language == "en-US" for s in segs)


@needs_espeak
def test_frontend_mandarin_and_detection(frontend):
    segs = frontend.process("价格是¥5。Plain English 2 here.", "")
    assert [(s.text, s.language) for s in segs] == [
        ("价格是¥5。", "cmn-CN"),
        ("Plain English 2 here.", "en-US"),
    ]
    assert segs[0].normalized == "价格是五元。"
    assert "w'u21_|" in segs[0].model_input  # 五 wu3
    assert segs[1].model_input == "pl'eIn 'INglIS t'u: h'i@3"
    assert frontend.process("你好", "zh")[0].language == "cmn-CN"  # matched by primary subtag


def test_frontend_characters_and_unconfigured_language():
    fe = FrontEnd({"en-US": {"g2p": "none"}})
    assert fe.languages == ("en-US",)
    assert fe.process("I have 2 cats. 你好3个", "en-US") == [
        Segment("I have 2 cats.", "I have two cats.", "I have two cats.", "en-US"),
        Segment("你好3个", "你好 three 个", "你好 three 个", "en-US"),
    ]
    # a language the manifest does not name: its normalisation, characters through
    assert fe.process("我有2个", "cmn-CN") == [Segment("我有2个", "我有两个", "我有两个", "cmn-CN")]
    assert fe.process("... !!", "en-US") == []  # nothing to say
    assert (
        FrontEnd({"en": {"g2p": "none", "normalize": False}}).process("2 cats", "en")[0].model_input
        == "2 cats"
    )
    with pytest.raises(ValueError, match="must be an object"):
        FrontEnd({"en-US": "espeak-ng"})


# --- segmentation ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,sentences",
    [
        (
            "Hello world. This is a test! Is it? Yes.",
            ["Hello world.", "This is a test!", "Is it?", "Yes."],
        ),
        ("Dr. Smith met Mr. Jones at St. Paul's.", ["Dr. Smith met Mr. Jones at St. Paul's."]),
        ("Pi is 3.14 today. Next.", ["Pi is 3.14 today.", "Next."]),
        ("Use e.g. a fork. Or approx. five.", ["Use e.g. a fork.", "Or approx. five."]),
        (
            "J. R. R. Tolkien wrote it. The U.S. Army left.",
            ["J. R. R. Tolkien wrote it.", "The U.S. Army left."],
        ),
        ('Wait... what? Really?! "Yes." Fine.', ["Wait... what?", "Really?!", '"Yes."', "Fine."]),
        ("I did it. Then I left.", ["I did it.", "Then I left."]),
        ("你好。今天天气很好！我们走吧？", ["你好。", "今天天气很好！", "我们走吧？"]),
        ("他说：“好的。”然后走了。", ["他说：“好的。”", "然后走了。"]),
        ("First para\n\nSecond para\nsame para", ["First para", "Second para\nsame para"]),
        ("no terminator at the end", ["no terminator at the end"]),
        ("  ", []),
    ],
)
def test_split_sentences(text, sentences):
    assert split_sentences(text, "en-US") == sentences


def test_split_sentences_caps_long_sentences_without_cutting_words():
    clause = "this clause keeps going for a while"
    text = ", ".join([clause] * 12) + "."
    parts = split_sentences(text, "en-US", max_chars=100)
    assert len(parts) > 1 and all(text_units(p) <= 100 for p in parts)
    assert " ".join(parts) == text
    words = "word " * 100
    parts = split_sentences(words, max_chars=50)
    assert all(set(p.split()) == {"word"} for p in parts) and len(parts) > 5
    han = "天" * 100
    parts = split_sentences(han, "cmn-CN", max_chars=60)
    assert "".join(parts) == han and all(text_units(p) <= 60 for p in parts)


def _stream(pieces, **kw):
    seg = StreamingSegmenter("en-US", **kw)
    emitted = [(i, s) for i, p in enumerate(pieces) for s in seg.push(p)]
    return emitted, seg.flush()


def test_streaming_never_cuts_numbers_or_words():
    emitted, rest = _stream(["It costs $1", "2.50 tod", "ay. Dr", ". Smith", " agr", "eed. "])
    assert emitted == [(2, "It costs $12.50 today."), (5, "Dr. Smith agreed.")]
    assert rest == []
    emitted, rest = _stream(["Open at 9 a.m", ". ", "Bring 5 etc", ". then", " go. "])
    assert emitted == [(2, "Open at 9 a.m."), (4, "Bring 5 etc. then go.")] and rest == []
    emitted, rest = _stream(["Pi is 3", ".", "14 and e", ".g", ". so on"])
    assert emitted == [] and rest == ["Pi is 3.14 and e.g. so on"]


def test_streaming_waits_for_what_follows_a_full_stop():
    seg = StreamingSegmenter("en-US")
    assert seg.push("Hello there.") == []  # could still be "there.com" or "there.\""
    assert seg.push(" ") == ["Hello there."]
    assert seg.push("Call Mr.") == []
    assert seg.push(" ") == []  # "Mr." never ends a sentence
    assert seg.push("Smith etc. ") == []  # "etc." may: the next word decides
    assert seg.push("How") == ["Call Mr. Smith etc."]
    assert seg.push(" are you?") == []
    assert seg.push(" ") == ["How are you?"]
    assert seg.pending == ""
    assert seg.flush() == []


def test_streaming_clause_threshold():
    long_clause = "This first clause is comfortably over forty characters,"
    emitted, rest = _stream(
        ["Short, ", "clauses, ", "wait. ", long_clause, " then more"], min_clause_chars=40
    )
    assert emitted == [(2, "Short, clauses, wait."), (4, long_clause)]
    assert rest == ["then more"]
    # the same text with a higher threshold waits for the sentence end
    emitted, rest = _stream([long_clause, " then more."], min_clause_chars=80)
    assert emitted == [] and rest == [long_clause + " then more."]
    seg = StreamingSegmenter("cmn-CN", min_clause_chars=20)
    assert seg.push("我们先去公园，") == ["我们先去公园，"]  # 7 wide characters: 21 units
    assert seg.push("然后，") == []
    assert seg.push("去吃饭。") == []  # a closing quote may still follow "。"
    assert seg.push("好") == ["然后，去吃饭。"]
    with pytest.raises(ValueError):
        StreamingSegmenter(min_clause_chars=100, max_chars=50)


def test_streaming_hard_cut_without_boundaries():
    seg = StreamingSegmenter(min_clause_chars=10, max_chars=30)
    out = []
    for word in ("lorem ipsum dolor sit amet " * 6).split(" "):
        out += seg.push(word + " ")
    out += seg.flush()
    assert all(text_units(s) <= 30 for s in out) and len(out) > 3
    assert " ".join(out).split() == ("lorem ipsum dolor sit amet " * 6).split()
    # a run with no space at all is no word: it is cut at the limit rather than held forever
    seg = StreamingSegmenter(min_clause_chars=10, max_chars=30)
    out = [s for _ in range(20) for s in seg.push("x" * 7)] + seg.flush()
    assert "".join(out) == "x" * 140 and all(len(s) <= 30 for s in out)


def test_streaming_flush():
    seg = StreamingSegmenter("en-US")
    assert seg.push("One. Two") == ["One."]
    assert seg.push(". Three etc.") == ["Two."]
    assert seg.pending == "Three etc."  # "etc." at the end: the next word would decide
    assert seg.flush() == ["Three etc."]
    assert seg.flush() == []
    assert seg.push("Next") == [] and seg.flush() == ["Next"]


_TEXTS = [
    "It costs $12.50 today. Dr. Smith agreed, e.g. with a nod! Is pi 3.14? Yes... it is.",
    "你好。价格是1，000元，好吗？他说：“好的。”然后走了。",
    "Wait, what?! The U.S. Army, at 3:45 pm, left.\n\nNew paragraph here; ok.",
]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(_TEXTS), st.lists(st.integers(0, 120), max_size=12))
def test_streaming_matches_whole_text_split(text, cuts):
    """However the text is cut into pieces, the sentences are those of the whole text."""
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
    seg = StreamingSegmenter("en-US", min_clause_chars=250)
    out = [s for p in pieces for s in seg.push(p)] + seg.flush()
    assert out == split_sentences(text, "en-US")
