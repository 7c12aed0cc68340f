"""Regression corpus for the text normalisers: dates, ordinals, money, times, units, abbreviations,
percentages, phone numbers and mixed scripts, each with the reading a listener expects."""

import pytest

from orchestrator.frontend import normalize_en, normalize_zh

EN_CORPUS = [
    # dates
    ("The 1st of May, 2024", "The first of May, twenty twenty-four"),
    ("On 5 June 2023 we met.", "On the fifth of June, twenty twenty-three we met."),
    ("On May 1st, 2024 we left.", "On May first, twenty twenty-four we left."),
    ("It was 12/25/2023.", "It was December twenty-fifth, twenty twenty-three."),
    ("Born on 2024-05-01.", "Born on May first, twenty twenty-four."),
    ("in 1999", "in nineteen ninety-nine"),
    ("in 2005", "in two thousand five"),
    ("in 1905", "in nineteen oh five"),
    ("the 1990s", "the nineteen nineties"),
    ("from 2010 to 2020", "from twenty ten to twenty twenty"),
    # ordinals
    ("The 2nd and 3rd runners.", "The second and third runners."),
    ("She came 21st.", "She came twenty-first."),
    ("the 100th time", "the one hundredth time"),
    ("the 112th floor", "the one hundred twelfth floor"),
    # cardinals
    ("We need 1,000,000 people.", "We need one million people."),
    ("I have 123 apples.", "I have one hundred twenty-three apples."),
    ("1001 nights", "one thousand one nights"),
    # money
    ("It costs $3.50.", "It costs three dollars and fifty cents."),
    ("It costs €12.", "It costs twelve euros."),
    ("It costs ¥100.", "It costs one hundred yen."),
    ("It costs £1.01.", "It costs one pound and one penny."),
    ("It costs $1.", "It costs one dollar."),
    ("$2.5 million", "two point five million dollars"),
    ("$5k", "five thousand dollars"),
    ("20 USD", "twenty US dollars"),
    # times
    ("Meet at 7:30 pm.", "Meet at seven thirty PM."),
    ("Meet at 7:05 a.m.", "Meet at seven oh five AM."),
    ("Meet at 7:05 a.m. Then go.", "Meet at seven oh five AM. Then go."),
    ("at 9 am", "at nine AM"),
    ("at 7 a.m. sharp", "at seven AM sharp"),
    # units
    ("It is 5 km away.", "It is five kilometers away."),
    ("It weighs 3.5 kg.", "It weighs three point five kilograms."),
    ("It is 20°C today.", "It is twenty degrees Celsius today."),
    ("1 km", "one kilometer"),
    ("60 mph", "sixty miles per hour"),
    # abbreviations
    ("He lives at 221B Baker St.", "He lives at two hundred twenty-one B Baker Street."),
    ("221B Baker St. is famous.", "two hundred twenty-one B Baker Street is famous."),
    ("Meet me on Elm St. Then go.", "Meet me on Elm Street. Then go."),
    ("St. Louis is a city.", "Saint Louis is a city."),
    ("Dr. Smith arrived.", "Doctor Smith arrived."),
    ("He saw Dr. Smith on Oak Dr.", "He saw Doctor Smith on Oak Drive."),
    ("Use a tool, e.g. a hammer.", "Use a tool, for example a hammer."),
    ("Mr. Jones and Mrs. Smith", "Mister Jones and Missus Smith"),
    ("Bring pens, paper, etc.", "Bring pens, paper, et cetera."),
    # percentages
    ("Sales rose 50%.", "Sales rose fifty percent."),
    ("a 3.5% rise", "a three point five percent rise"),
    # phone-like numbers
    ("Call 555-123-4567.", "Call five five five, one two three, four five six seven."),
    ("Call (555) 123-4567.", "Call five five five, one two three, four five six seven."),
    (
        "Call +44 20 7946 0958.",
        "Call plus four four, two zero, seven nine four six, zero nine five eight.",
    ),
    # symbols and fractions
    ("5 - 3", "five minus three"),
    ("Page #5", "Page number five"),
    ("1/2 cup", "one half cup"),
]

ZH_CORPUS = [
    # digits in Mandarin, measure words
    ("我有3个苹果", "我有三个苹果"),
    ("我有2个孩子", "我有两个孩子"),
    ("10001人", "一万零一人"),
    ("人口14亿", "人口十四亿"),
    ("共100,000元", "共十万元"),
    ("第1名", "第一名"),
    ("3-5天", "三到五天"),
    ("1/3的人", "三分之一的人"),
    # dates and times
    ("2024年5月1日", "二零二四年五月一日"),
    ("今天是2024年5月1日。", "今天是二零二四年五月一日。"),
    ("他在2023年去了北京", "他在二零二三年去了北京"),
    ("1990年代", "一九九零年代"),
    ("现在7:30。", "现在七点三十分。"),
    # money
    ("价格是¥100。", "价格是一百元。"),
    ("价格是¥3.50。", "价格是三元五角。"),
    ("一共12.5元", "一共十二点五元"),
    ("$20", "二十美元"),
    ("€12", "十二欧元"),
    # units
    ("3.5公斤", "三点五公斤"),
    ("温度20°C", "温度二十摄氏度"),
    ("跑了5km", "跑了五公里"),
    # percentages
    ("50%", "百分之五十"),
    ("增长了12.5%", "增长了百分之十二点五"),
    # phone numbers
    ("打电话13812345678", "打电话一三八一二三四五六七八"),
    # mixed scripts: English words stay, numbers next to them are read in Chinese
    ("英文Hello World很好", "英文Hello World很好"),
    ("我用iPhone 15拍照", "我用iPhone 十五拍照"),
]


@pytest.mark.parametrize("text,expected", EN_CORPUS)
def test_english_corpus(text, expected):
    assert normalize_en(text) == expected


@pytest.mark.parametrize("text,expected", ZH_CORPUS)
def test_mandarin_corpus(text, expected):
    assert normalize_zh(text) == expected


def test_large_mandarin_numbers_read_the_standard_way():
    assert normalize_zh("5,894,250,938,496") == "五万八千九百四十二亿五千零九十三万八千四百九十六"
